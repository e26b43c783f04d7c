"""What a routed generation returns: text, per-token records with provenance, and request metrics."""
from __future__ import annotations

import html
import math
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

from tokenrouter.engine.sequence import TokenRecord

MODEL_COLOURS = ["#cfe8ff", "#ffd6a5", "#d8f5c8", "#f1d4ff"]


@dataclass(slots=True)
class RequestMetrics:
    ttft: float  # seconds to the first token
    tpot: float  # mean seconds per output token after the first
    e2e: float  # seconds from arrival to the last token
    itl: list[float]  # seconds between consecutive tokens
    tokens_per_model: dict[str, int]
    large_share: float  # share of output tokens written by the last (largest) model
    handoffs: int
    tokens_computed: dict[str, int]  # tokens each model ran forward, prompt and catch-ups included
    discarded_tokens: int = 0  # written, then dropped when a query-level decision restarted the response
    drafted: int = 0  # verification: drafts the verifier judged
    accepted: int = 0  # of them, accepted (the rest were rolled back)
    corrections: int = 0  # the verifier's tokens in place of a rejected draft
    tolerated: int = 0  # accepted drafts the verifier would not have written (a policy's `tolerance`)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else math.nan

    @property
    def rolled_back(self) -> int:
        return self.drafted - self.accepted

    @classmethod
    def from_records(cls, records: list[TokenRecord], models: list[str], handoffs: int,
                     tokens_computed: dict[str, int], e2e: float, discarded: int = 0, drafted: int = 0,
                     accepted: int = 0) -> RequestMetrics:
        times = [r.t for r in records]
        written = [r.model for r in records]
        counts = {m: written.count(m) for m in models}
        n = len(records)
        return cls(
            ttft=times[0] if times else math.nan,
            tpot=(times[-1] - times[0]) / (n - 1) if n > 1 else math.nan,
            e2e=e2e,
            itl=[b - a for a, b in zip(times, times[1:])],
            tokens_per_model=counts,
            large_share=counts[models[-1]] / n if n and len(models) > 1 else 0.0,
            handoffs=handoffs,
            tokens_computed=dict(tokens_computed),
            discarded_tokens=discarded,
            drafted=drafted,
            accepted=accepted,
            corrections=sum([r.correction for r in records]),
            tolerated=sum([r.tolerated for r in records]),
        )


@dataclass(slots=True)
class RoutedOutput:
    text: str
    tokens: list[TokenRecord]
    finish_reason: str
    prompt_tokens: int
    policy: str
    models: list[str]
    metrics: RequestMetrics
    error: str = field(default="")

    @property
    def token_ids(self) -> list[int]:
        return [r.token_id for r in self.tokens]

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([asdict(r) for r in self.tokens])

    def _repr_html_(self) -> str:
        return render_html(self.tokens, self.models) + self._summary_html()

    def _summary_html(self) -> str:
        m = self.metrics
        counts = ", ".join(f"{k}: {v}" for k, v in m.tokens_per_model.items())
        return (f"<div style='font-size:0.85em;color:#555;margin-top:4px'>{len(self.tokens)} tokens ({counts}); "
                f"large share {m.large_share:.0%}; hand-offs {m.handoffs}; TTFT {m.ttft * 1e3:.0f} ms; "
                f"TPOT {m.tpot * 1e3:.0f} ms; end-to-end {m.e2e:.2f} s; policy {html.escape(self.policy)}; "
                f"finish {self.finish_reason}</div>")


class RoutedStream:
    """An async iterator of a request's TokenRecords; once exhausted, `output` holds its RoutedOutput
    (text, finish reason, hand-offs and the tokens each model computed, which the records alone lack)."""

    def __init__(self, items: AsyncIterator[TokenRecord | RoutedOutput]):
        self._items = items
        self.output: RoutedOutput | None = None

    def __aiter__(self) -> RoutedStream:
        return self

    async def __anext__(self) -> TokenRecord:
        item = await self._items.__anext__()
        if isinstance(item, RoutedOutput):
            self.output = item
            await self._items.aclose()
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        await self._items.aclose()


def render_html(records: list[TokenRecord], models: list[str]) -> str:
    """Tokens as spans coloured by the model that wrote them, the router score on hover, and a legend. A
    verifier's correction (its token in place of a draft it rejected) is outlined in red, a draft it kept under a
    policy's `tolerance` though it would have written another token in dashed orange."""
    colour = {m: MODEL_COLOURS[i % len(MODEL_COLOURS)] for i, m in enumerate(models)}
    legend = " ".join(f"<span style='background:{colour[m]};padding:0 4px'>{html.escape(m)}</span>" for m in models)
    marks = [_mark(r) for r in records]
    legend += "".join(f" <span style='{style};padding:0 4px'>{name}</span>" for name, style in MARKS.items()
                      if name in marks)
    spans = "".join(
        f"<span class='tr-tok tr-{html.escape(r.model)}{f' tr-{mark}' if mark else ''}' "
        f"style='background:{colour.get(r.model, '#eee')}{f';{MARKS[mark]}' if mark else ''}' "
        f"title='{html.escape(r.model)}{_provenance(r)} · score {_fmt(r.score)} · {r.t * 1e3:.0f} ms'>"
        f"{html.escape(r.text)}</span>"
        for r, mark in zip(records, marks))
    return (f"<div style='font-size:0.85em'>{legend}</div>"
            f"<pre style='white-space:pre-wrap;font-family:monospace'>{spans}</pre>")


MARKS = {"correction": "outline:2px solid #d62728;outline-offset:-1px",  # a verifier's outline per kind of token
         "tolerated": "outline:2px dashed #ff7f0e;outline-offset:-1px"}


def _mark(r: TokenRecord) -> str:
    return "correction" if r.correction else "tolerated" if r.tolerated else ""


def _provenance(r: TokenRecord) -> str:
    if r.correction:
        return " · correction"
    return " · tolerated (verified, not the verifier's choice)" if r.tolerated else " · verified" if r.verified else ""


def _fmt(score: float) -> str:
    return "-" if math.isnan(score) else f"{score:.3f}"
