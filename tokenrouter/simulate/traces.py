"""Routing traces: per request, what a simulated engine replays.

A request of a trace has its prompt and output lengths (and, when recorded, their token ids), the output positions
whose token its home policy sent to the large model (`sent`), and, for a verifying policy, the positions whose
draft the verifier rejected (`rejected`: the large model's token replaced it). Where a draft was accepted, or no
draft was judged, the output token is the recorded one.

Traces are recorded from real runs (`bench serve --record-trace`, `bench quality --record-trace`) or synthetic:
lengths drawn from log-normal distributions clipped to a range, sends from a two-state Markov chain with the
given share and mean burst length (1 / (1 - share), the default, is independent sends). Presets shaped like the
published workloads: `reasoning` (short prompts, long outputs up to 8,192 tokens) and `multi-turn` (about 8,192
input and 1,024 output tokens), and `short` (this project's benchmark prompts and answers).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

TRACE_VERSION = 1
FILLER = 32  # synthetic token ids are FILLER + position % 64: below every vocabulary, and not special


@dataclass(slots=True)
class TraceRequest:
    prompt_tokens: int
    output_tokens: int
    sent: list[int] = field(default_factory=list)  # output positions the home policy sent to the large model
    rejected: list[int] = field(default_factory=list)  # output positions whose draft the verifier rejected
    prompt_ids: list[int] = field(default_factory=list)  # recorded ids ([]: synthetic)
    output_ids: list[int] = field(default_factory=list)

    def prompt(self) -> list[int]:
        return self.prompt_ids or [FILLER] * self.prompt_tokens

    def token(self, position: int) -> int:
        if position < len(self.output_ids):
            return self.output_ids[position]
        return FILLER + position % 64

    def tokens(self, n: int) -> list[int]:
        """`token(p)` for p in range(n), at once."""
        ids = self.output_ids[:n]
        ids += [FILLER + p % 64 for p in range(len(ids), n)]
        return ids


@dataclass(slots=True)
class Trace:
    requests: list[TraceRequest]
    policy: str  # the policy of the recorded run ("random:share=0.15", "verify:every=4"), or what a synthetic one models
    source: str  # how it was made: the command, or the synthetic preset and parameters
    machine: str = ""  # where a recorded run ran
    profiles: dict[str, dict] = field(default_factory=dict)  # the recorded run's engine step profiles, by model
    overheads: dict[str, float] = field(default_factory=dict)  # and its seconds per step outside the forward, by model

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def large_share(self) -> float:
        """The share of output tokens the large model wrote (a send or a rejected draft each gives it one)."""
        total = self.output_tokens
        return sum(len(r.sent) + len(r.rejected) for r in self.requests) / total if total else 0.0

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"version": TRACE_VERSION, **asdict(self)}))

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """A saved trace; ValueError naming the file and what is wrong with it."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: cannot read a routing trace: {e}") from None
        if not isinstance(data, dict) or data.pop("version", None) != TRACE_VERSION:
            raise ValueError(f"{path}: not a version-{TRACE_VERSION} routing trace")
        try:
            requests = [TraceRequest(**r) for r in data.pop("requests")]
            trace = cls(requests, **data)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a routing trace: {type(e).__name__}: {e}") from None
        for i, r in enumerate(requests):
            if r.prompt_tokens < 1 or r.output_tokens < 1:
                raise ValueError(f"{path}: requests[{i}]: needs at least one prompt and one output token")
            if any(not 0 <= p < r.output_tokens for p in (*r.sent, *r.rejected)):
                raise ValueError(f"{path}: requests[{i}]: a sent or rejected position is outside its output")
        return trace


# ---- recording ---------------------------------------------------------------------------------------------------
def from_outputs(prompts: list[list[int]], outs: list, large: str, policy: str, source: str, machine: str = "",
                 profiles: dict | None = None, verifies: bool = False, overheads: dict | None = None) -> Trace:
    """The trace of a real run: each request's prompt and output ids, where the large model wrote (a token-level
    policy's sends) or corrected (a verifying policy's rejected drafts). Failed requests are left out. `profiles`
    and `overheads`: the run's step profiles and its per-step time outside the forward pass, by model."""
    requests = []
    for ids, out in zip(prompts, outs):
        if out.error or not out.tokens:
            continue
        records = out.tokens
        wrote = [i for i, r in enumerate(records) if r.model == large]
        rejected = [i for i, r in enumerate(records) if r.correction]
        requests.append(TraceRequest(len(ids), len(records), [] if verifies else wrote, rejected, list(ids),
                                     [r.token_id for r in records]))
    return Trace(requests, policy, source, machine, profiles or {}, overheads or {})


# ---- synthetic ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Lengths:
    """A log-normal length with this median, clipped to [low, high]; sigma 0 is a fixed length."""
    median: int
    low: int
    high: int
    sigma: float = 0.5

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.sigma == 0:
            return [self.median] * n
        x = rng.lognormal(math.log(self.median), self.sigma, n)
        return [int(v) for v in np.clip(np.rint(x), self.low, self.high)]


PRESETS: dict[str, tuple[Lengths, Lengths, str]] = {
    "reasoning": (Lengths(160, 32, 512), Lengths(3000, 256, 8192, 0.8),
                  "short-input reasoning, long outputs up to 8,192 tokens"),
    "multi-turn": (Lengths(8192, 6144, 8192, 0.1), Lengths(1024, 512, 1024, 0.2),
                   "multi-turn sessions, about 8,192 input and 1,024 output tokens"),
    "short": (Lengths(30, 16, 64, 0.3), Lengths(48, 48, 48, 0.0), "this project's benchmark prompts, 48 output tokens"),
}


def synthetic(preset: str, requests: int, share: float, burst: float = 0.0, seed: int = 0,
              policy: str = "") -> Trace:
    """`requests` requests of a preset's lengths; each output position sent with long-run probability `share`,
    in runs of mean length `burst` (0: independent sends)."""
    if preset not in PRESETS:
        raise ValueError(f"--workload: unknown {preset!r}; known: {', '.join(PRESETS)}")
    if not 0 <= share < 1:
        raise ValueError(f"--share: must be in [0, 1), got {share}")
    independent = 1 / (1 - share)
    burst = burst or independent
    if burst < 1:
        raise ValueError(f"--burst: a mean run length, must be >= 1 (or 0: independent sends), got {burst}")
    stay = 1 - 1 / burst  # P(send | the last position was sent)
    start = share / (burst * (1 - share)) if share else 0.0  # P(send | not sent), so that the long-run share holds
    if start > 1:
        raise ValueError(f"--burst: runs of {burst} cannot give a share of {share} (at least {share / (1 - share):.2f})")
    prompt_len, output_len, _ = PRESETS[preset]
    rng = np.random.default_rng(seed)
    prompts, outputs = prompt_len.draw(rng, requests), output_len.draw(rng, requests)
    out = []
    for p, n in zip(prompts, outputs):
        draws, sent, last = rng.random(n), [], False
        for i in range(n):
            last = bool(draws[i] < (stay if last else start))
            if last:
                sent.append(i)
        out.append(TraceRequest(p, n, sent))
    spec = policy or f"random:share={share:g}"
    return Trace(out, spec, f"synthetic {preset}: {requests} requests, share {share:g}, burst {burst:g}, seed {seed}")


# ---- replay ------------------------------------------------------------------------------------------------------
class Replay:
    """What the simulated workers ask of a trace, by request: a request's sampling seed is its index in the trace.
    Only sequences of `policy` (the trace's policy object) route by the trace; others (the baselines' all-small,
    all-large and query-level runs) write the same tokens without sending."""

    def __init__(self, trace: Trace, large: str):
        self.trace, self.large = trace, large
        self.policy = None
        self._sent = [frozenset(r.sent) for r in trace.requests]
        self._rejected = [frozenset(r.rejected) for r in trace.requests]
        self._tokens: list[list[int] | None] = [None] * len(trace.requests)  # by request, made when first asked

    def writer(self, request: int, policy, model: str):
        """(the tokens `model` writes at output positions 0, 1, ... (a list: the recorded length and one more, or
        none), the token it writes at any output position, whether the policy sends the position) for a sequence of
        `policy`: looked up once per sequence, asked at every token."""
        trace_request, rejected = self.trace.requests[request], self._rejected[request]
        sends = self._sent[request].__contains__ if policy is self.policy else _NEVER
        if model == self.large or not policy.verifies or not rejected:
            table = self._tokens[request]
            if table is None:  # NOTE: one list for every model and run, read without a call per token
                table = self._tokens[request] = trace_request.tokens(trace_request.output_tokens + 1)
            return table, trace_request.token, sends

        def draft(position: int) -> int:
            token = trace_request.token(position)
            if position in rejected:
                return token - 1 if token > 0 else token + 1  # a draft unlike the verifier's token
            return token
        return (), draft, sends


_NEVER = frozenset().__contains__  # no position is sent
