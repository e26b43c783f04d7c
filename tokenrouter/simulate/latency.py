"""Step-latency models: the seconds one engine step takes, from the step's rows alone.

Every model answers `step_seconds(new_tokens, contexts, logit_rows)` for a step whose row i computes
`new_tokens[i]` tokens, the last attending to `contexts[i]` tokens, with `logit_rows` logit rows in all (one per
complete row; a verifying catch-up has one per judged draft too).

- `RooflineLatency`: FLOPs and bytes over a device's peaks, plus a per-layer launch floor. A step reads the
  weights once and each row's context of KV once, writes the new tokens' KV, and multiplies every new token
  through every projection; its time is the larger of the compute and the memory time, plus the floor.
  Tensor parallelism splits weights, KV and FLOPs over the ranks and adds two all-reduces per layer.
- `ProfiledLatency`: measured step times. Decode steps by batch at a base context (an engine profile, or a
  `bench runner` table), a context slope fitted where the table has longer contexts (the extra KV each row
  reads), and the cost of tokens beyond one per row from the engine profile's chunk and verify steps, a CUDA
  table's catch-up and verifying steps (replayed graphs where captured), or, where the table has none (the shipped
  H200 tables time decode steps only), from a roofline of the same model; plus,
  for a recorded trace, the time each step of the recorded run spent outside the forward pass (an engine
  profile times the forward alone; the worker's host work and the driver's scheduling are part of every step).
- `HandoffLink`: wraps either, adding the network transfer of a hand-off when two models live on different nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from operator import mul, sub

from tokenrouter.engine.throughput_model import StepProfile, _interpolate, _monotone
from tokenrouter.simulate.devices import Device, Network
from tokenrouter.simulate.shapes import ModelShape


@dataclass(slots=True)
class RooflineLatency:
    shape: ModelShape
    device: Device
    dtype_bytes: float = 2.0
    tensor_parallel: int = 1
    per_step: tuple = field(init=False, repr=False, compare=False)  # what every step's cost multiplies, computed once

    def __post_init__(self):
        s, d = self.shape, self.device
        self.per_step = (2 * s.layers * s.layer_params, 2 * s.hidden * s.vocab, 4 * s.layers * s.heads * s.head_dim,
                         s.kv_bytes_per_token(self.dtype_bytes), d.peak_tflops * 1e12 * d.compute_efficiency,
                         s.streamed_parameters * self.dtype_bytes / d.memory_efficiency, d.memory_gbps * 1e9,
                         s.layers * d.layer_floor_us * 1e-6)

    def parts(self, new_tokens: list[int], contexts: list[int], logit_rows: int) -> tuple[float, float, float]:
        """(compute seconds, memory seconds, floor seconds) of one step, per rank."""
        s, d, tp = self.shape, self.device, self.tensor_parallel
        per_token, per_logit, per_pair, kv_per_token, flops_per_s, weights, bytes_per_s, floor = self.per_step
        tokens = sum(new_tokens)
        # the attended pairs of a chunk of n tokens ending at context c: c + (c - 1) + ... + (c - n + 1), that is
        # n c - n (n - 1) / 2 (NOTE: summed as integers: the terms and their float sum are whole numbers far below 2^53,
        # so the same; n (n - 1) is 0 for a row of one token, and both sums run without a Python loop)
        excess = sum(map(mul, new_tokens, map(sub, new_tokens, repeat(1))))
        pairs = float(sum(map(mul, new_tokens, contexts)) - excess // 2)
        flops = per_token * tokens + per_logit * logit_rows + per_pair * pairs
        kv = kv_per_token * (sum(contexts) + tokens)
        compute = flops / tp / flops_per_s
        memory = (weights + kv / d.kv_efficiency) / tp / bytes_per_s
        if tp > 1:  # two ring all-reduces of the step's hidden states per layer
            size = tokens * s.hidden * self.dtype_bytes
            floor += 2 * s.layers * (2 * (tp - 1) / tp * size / (d.link_gbps * 1e9) + d.link_latency_us * 1e-6)
        return compute, memory, floor

    def step_seconds(self, new_tokens: list[int], contexts: list[int], logit_rows: int) -> float:
        compute, memory, floor = self.parts(new_tokens, contexts, logit_rows)
        return max(compute, memory) + floor


@dataclass(slots=True)
class ProfiledLatency:
    decode: dict[int, float]  # seconds per decode step by batch, at `context` tokens per row
    context: int
    context_slope: float = 0.0  # seconds per context token per row beyond `context`
    profile: StepProfile | None = None  # an engine profile: chunk and verify steps
    catch_up: dict[int, dict[int, float]] = field(default_factory=dict)  # tokens per row -> batch -> seconds
    verify: dict[int, dict[int, float]] = field(default_factory=dict)  # the same, of verifying steps
    extra: RooflineLatency | None = None  # else: what tokens beyond one per row add, from a roofline
    overhead: float = 0.0  # seconds per step outside the forward pass (the worker's host work, the driver's)
    source: str = ""

    def step_seconds(self, new_tokens: list[int], contexts: list[int], logit_rows: int) -> float:
        batch = len(new_tokens)
        per_row = sum(new_tokens) / batch
        if self.profile is not None:
            seconds = self.profile.step_time(batch, per_row, verify=logit_rows > batch)
        elif per_row > 1 and (measured := self.verify if self.verify and logit_rows > batch else self.catch_up):
            # measured rows of several tokens: by tokens per row, then batch; a verifying step (a logit row at every
            # token) from its own measurements where the table has them, as an engine profile's (StepProfile)
            by_length = {1: _interpolate(self.decode, batch),
                         **{n: _interpolate(times, batch) for n, times in measured.items()}}
            seconds = _interpolate(by_length, per_row)
        else:
            seconds = _interpolate(self.decode, batch)
            if per_row > 1 and self.extra is not None:
                seconds += max(0.0, self.extra.step_seconds(new_tokens, contexts, logit_rows)
                               - self.extra.step_seconds([1] * batch, contexts, batch))
        return seconds + self.overhead + self.context_slope * sum(max(0, c - self.context) for c in contexts)

    @classmethod
    def from_points(cls, points: list[tuple[int, int, float]], extra: RooflineLatency | None = None,
                    source: str = "", catch_up: dict[int, dict[int, float]] | None = None,
                    verify: dict[int, dict[int, float]] | None = None) -> ProfiledLatency:
        """From measured (batch, context, seconds) decode steps: the batch curve at the smallest context, and
        the least-squares slope of the rest over the context tokens they read beyond it; `catch_up`: measured steps
        of rows of several tokens (tokens per row -> batch -> seconds), which then price such rows; `verify`: the
        same of verifying steps, which then price those."""
        base = min(c for _, c, _ in points)
        decode = _monotone({b: t for b, c, t in points if c == base})  # as an engine profile (throughput_model)
        rest = [(b * (c - base), t - _interpolate(decode, b)) for b, c, t in points if c > base]
        slope = sum(x * y for x, y in rest) / sum(x * x for x, _ in rest) if rest else 0.0
        return cls(decode, base, max(0.0, slope), catch_up={n: _monotone(t) for n, t in (catch_up or {}).items()},
                   verify={n: _monotone(t) for n, t in (verify or {}).items()}, extra=extra, source=source)

    @classmethod
    def from_profile(cls, profile: StepProfile, context: int = 32, overhead: float = 0.0,
                     source: str = "") -> ProfiledLatency:
        """From an engine profile (`throughput_model.profile_runner`: decode, chunk and verify steps at `context`)."""
        return cls(dict(profile.decode), context, profile=profile, overhead=overhead, source=source)


@dataclass(slots=True)
class HandoffLink:
    """`inner`'s step, plus moving the step's catch-up rows over a network link: the token ids of every row of
    more than one token (what a hand-off carries; each model keeps its own KV cache) and the step's result back."""
    inner: object
    network: Network
    bytes_per_token: int = 4

    def step_seconds(self, new_tokens: list[int], contexts: list[int], logit_rows: int) -> float:
        moved = sum(n for n in new_tokens if n > 1)
        seconds = self.inner.step_seconds(new_tokens, contexts, logit_rows)
        if moved:
            seconds += 2 * self.network.latency_us * 1e-6 + moved * self.bytes_per_token / (self.network.gbps * 1e9)
        return seconds


def step_profile(latency, context: int) -> StepProfile:
    """The engine's profile shape (throughput_model.StepProfile) of any latency model at one context, so the
    runtime's tau choice reads the simulated device as it reads a measured one."""
    from tokenrouter.engine.throughput_model import BATCHES, CHUNKS, VERIFY_BATCHES, VERIFY_ROWS

    decode = {b: latency.step_seconds([1] * b, [context] * b, b) for b in BATCHES}
    chunk = {n: latency.step_seconds([n], [context + n], 1) for n in CHUNKS}
    verify = {n: {b: latency.step_seconds([n] * b, [context + n] * b, n * b) for b in VERIFY_BATCHES}
              for n in VERIFY_ROWS}
    return StepProfile(decode, chunk, verify=verify)
