"""HTML for a live request: the tokens coloured by model (the library's `render_html`, shared with the
notebook view) and a metrics strip."""
from __future__ import annotations

import html
import math

from app.live import LiveRequest
from app.pricing import dollars_text
from tokenrouter.service.output import render_html

STATUS = "<div class='tr-status' style='font-size:0.9em;color:#555'>{}</div>"
ERROR = "<div class='tr-error' style='color:#b00020;font-weight:600'>{}</div>"


def tokens_html(request: LiveRequest) -> str:
    return render_html(request.records, request.models)


def metrics_html(request: LiveRequest) -> str:
    s = request.summary()
    counts = ", ".join(f"{html.escape(m)} {n}" for m, n in s["tokens_per_model"].items())
    items = [f"<b>{s['tokens']}</b> tokens ({counts})", f"{s['tokens_per_s']:.1f} tokens/s",
             f"TTFT {_ms(s['ttft_ms'])}", f"large share {s['large_share']:.0%}", f"hand-offs {s['handoffs']}",
             _time(request, s['latency_s']), f"cost {dollars_text(s['cost'], s['cost_estimated'])}", f"<i>{html.escape(s['finish'])}</i>"]
    corrections = sum(r.correction for r in request.records)
    verified = sum(r.verified for r in request.records)
    tolerated = sum(r.tolerated for r in request.records)
    if verified or corrections:  # a verifying policy: drafts the large model kept, and its corrections
        items.insert(5, f"verified {verified} &middot; corrections {corrections}"
                        + (f" &middot; tolerated {tolerated}" if tolerated else ""))
    strip = "<div class='tr-metrics' style='font-size:0.9em'>" + " &middot; ".join(items) + "</div>"
    return strip + (ERROR.format(html.escape(request.error)) if request.error else "")


def message_html(text: str, error: bool = True) -> str:
    return (ERROR if error else STATUS).format(html.escape(text))


def _time(request: LiveRequest, seconds: float) -> str:
    """The elapsed time while the request runs (redrawn even while no token arrives), its latency after."""
    return f"elapsed {seconds:.1f} s" if request.running else f"latency {seconds:.2f} s"


def _ms(value: float) -> str:
    return "&ndash;" if math.isnan(value) else f"{value:.0f} ms"


def comparison_html(requests: list[LiveRequest]) -> str:
    """One line under two answers once both ended: which was cheaper and which faster for this prompt, by how
    much, and plainly when query-level routing won against token-level."""
    if len(requests) != 2 or any(r.running for r in requests):
        return ""
    if any(r.error for r in requests):
        return STATUS.format("No comparison: " + html.escape(next(r.error for r in requests if r.error)))
    names = [f"{_level(r)}-level <code>{html.escape(r.spec)}</code>" for r in requests]
    parts = []
    if all(r.cost is not None for r in requests):
        parts.append(_versus(names, [r.cost for r in requests], "cheaper", "cost the same",
                             lambda v: dollars_text(v, any(r.cost_estimated for r in requests))))
    parts.append(_versus(names, [r.elapsed for r in requests], "faster", "took the same time", lambda v: f"{v:.2f} s"))
    lengths = [len(r.records) for r in requests]
    line = "For this prompt, " + "; ".join(parts)
    if lengths[0] != lengths[1]:
        line += f" (answers of {lengths[0]} and {lengths[1]} tokens)"
    line += "."
    levels = [_level(r) for r in requests]
    if sorted(levels) == ["query", "token"] and all(r.cost is not None for r in requests):
        query, token = (requests if levels[0] == "query" else requests[::-1])
        if query.cost < token.cost:
            line += (f" Query-level routing won on cost here: one model wrote the whole answer, while the token-level "
                     f"policy's {token.handoffs} hand-offs each had the large model catch up on the tokens it had "
                     f"missed" + (", and it was faster too." if query.elapsed < token.elapsed else "."))
    if any(r.stopped for r in requests):
        line += " Stopped early: costs so far, estimated from the tokens written."
    return f"<div class='tr-compare' style='font-size:0.95em;margin-top:4px'>{line}</div>"


def _versus(names: list[str], values: list[float], better: str, same: str, fmt) -> str:
    """"A was cheaper: $x against $y (12% less)", or "both ...", for two values where less is better."""
    a, b = values
    if fmt(a) == fmt(b):
        return f"both {same} ({fmt(a)})"
    win, lose = (0, 1) if a < b else (1, 0)
    saved = 1 - values[win] / values[lose] if values[lose] > 0 else 0.0
    return f"{names[win]} was {better}: {fmt(values[win])} against {fmt(values[lose])} ({saved:.0%} less)"


def _level(request: LiveRequest) -> str:
    return getattr(request.policy, "level", "token")
