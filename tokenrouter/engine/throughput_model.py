"""Predicts output tokens/s and per-token latency of a routed workload, and picks the delayed-batching
threshold tau for the large model.

Inputs: concurrency C, the share p of tokens the large model writes, and each model's step latency
as a function of batch size and chunk length (profiled once per model and machine, then cached), plus
how much each model slows down while the other steps at the same time (both share the memory bus on
a CPU, or the device on one GPU).

Mean-value model, solved by fixed-point iteration. Every output token of a request costs one home
(small) step S and, with probability p, a wait W and a large step L:
    T = S + p (W + L),   X = C / T  tokens/s,   TPOT = T.
Little's law gives the batch at the small model, n_s = C S / T; the large model collects
b_l = 1 + p X (tau + L) hand-offs per step (at most C); W = tau / 2 + v_l L / 2.
A request waits for, or is slowed by, only the other requests' steps at the other model: v = u (C - 1) / C
(at C = 1 a token costs exactly S + p L).
- Models on one device (`shared_device`, the default on a CPU) take turns: a step waits on average
  half a step of the other model while that one is busy (S = s + v_l l / 2), and the device caps
  throughput at X <= 1 / (s / n_s + p l / b_l); requests then queue for the device in proportion to their
  time at each model, so n_s stays C S / T. Hand-offs come only as home steps end, so a large step takes
  those of one home step (each of its n_s rows sends with probability q = p / h; at least one) and those of
  its delay: b_l = n_s q / (1 - (1 - q)^n_s) + p X tau. Fuller large steps (a longer tau) lower the cap's
  second term, at the price of W.
- On separate devices the models step in parallel and contention stretches each step by the other's
  utilisation: S = s (1 + k_s v_l), L = l (1 + k_l v_s), with k measured at start-up.
Here s = s(n_s) and l = l(b_l, 1/p) are the profiled step times and u = step rate x step time.

Verifying policies (engine/verification.py) change two of the inputs: a token costs h home steps instead of
one (T = h S + p (W + L)), and each visit writes the accepted drafts as well as the large model's token. With
acceptance rate a (accepted / drafted, as `metrics.acceptance_rate` counts it: every judged draft, those after
the first rejected one too) and m drafts judged per visit, a visit yields E = 1 + a m tokens, so p = 1 / E,
h = m / E (plus 1 / E for the home step that decided to send, `verify:of`), catch-up m + 1.
"""
from __future__ import annotations

from bisect import bisect_left
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from tokenrouter.engine.model_runner import Chunk

log = logging.getLogger(__name__)

BATCHES = (1, 2, 4, 8, 16)
CHUNKS = (1, 4, 16, 64)
VERIFY_BATCHES = (1, 4, 16)
VERIFY_ROWS = (3, 9)  # tokens per row of a verifying catch-up (k drafts and the token before them), logits at each
# part of the cache key: profiles of an older version are measured again (3: the CPU thread choice and the chunk
# attention of 2026-12-04 changed step times; 4: CPU models load on their device thread, whose two-thread steps
# had run no faster than one-thread ones, 2026-12-05)
PROFILE_VERSION = 4
ENOUGH_S = 0.4  # a profile point stops repeating its step once its timed runs have taken this long
MAX_ITERATIONS = 200  # of predict()'s fixed-point iteration
CONVERGED = 1e-12  # relative change of every quantity at which predict() stops


@dataclass(slots=True)
class StepProfile:
    """Measured seconds per step: decode at batch sizes, one sequence's chunk of n tokens, and verifying steps
    (`verify[n][b]`: b rows of n tokens, logits at every position)."""
    decode: dict[int, float]
    chunk: dict[int, float]
    slowdown: float = 0.0  # fractional slowdown while the other model steps concurrently
    verify: dict[int, dict[int, float]] = field(default_factory=dict)

    def __post_init__(self):
        # NOTE: a step of more rows (or tokens) does all the work of one of fewer, so it never takes less: a smaller
        # batch measured slower than a larger one was measured while something else ran (seen on a 2-core CPU: the
        # 1.5B's decode at 385 ms at batch 1 and 183 ms at batch 4), and takes the larger one's time
        self.decode, self.chunk = _monotone(self.decode), _monotone(self.chunk)
        self.verify = {n: _monotone(times) for n, times in self.verify.items()}

    def step_time(self, batch: float, tokens_per_row: float = 1.0, verify: bool = False) -> float:
        """A step of `batch` sequences that each compute `tokens_per_row` tokens (1: decode; more: catch-up).
        NOTE: the tokens beyond one per row cost what they add to a chunk of all the step's tokens, since the
        projections, which dominate, see only the total; a verifying step (logits at every token) is read from
        its own measurements where the profile has them, since its rows of several tokens, unlike decode rows,
        each pay for their own attention and output rows."""
        return self.timer(tokens_per_row, verify)(batch)

    def timer(self, tokens_per_row: float = 1.0, verify: bool = False) -> Callable[[float], float]:
        """`step_time` at these rows, as a function of the batch, its tables read once (predict() asks for it at
        every iteration)."""
        decode = _curve(self.decode)
        if tokens_per_row <= 1:  # a decode step (NOTE: from batch 1 up: a batch below reads the first point, as 1 does)
            return decode if min(self.decode) >= 1 else lambda batch: decode(batch if batch > 1.0 else 1.0)
        if verify and self.verify:
            curves = {1: decode, **{n: _curve(times) for n, times in self.verify.items()}}
            lengths = sorted(curves)
            by_length = [curves[n] for n in lengths]

            def verifying(batch: float) -> float:
                batch = max(1.0, batch)
                return _line(lengths, [c(batch) for c in by_length])(tokens_per_row)
            return verifying
        chunk = _curve(self.chunk)

        def catch_up(batch: float) -> float:
            batch = batch if batch > 1.0 else 1.0
            extra = chunk(batch * tokens_per_row) - chunk(batch)
            return decode(batch) + (extra if extra > 0.0 else 0.0)
        return catch_up

    @classmethod
    def from_dict(cls, d: dict) -> StepProfile:
        return cls({int(k): v for k, v in d["decode"].items()}, {int(k): v for k, v in d["chunk"].items()},
                   d.get("slowdown", 0.0),
                   {int(n): {int(b): v for b, v in t.items()} for n, t in d.get("verify", {}).items()})


@dataclass(slots=True)
class Prediction:
    tokens_per_s: float
    tpot: float  # seconds per output token of one request
    small_batch: float
    large_batch: float
    tau: float
    large_utilisation: float
    small_utilisation: float


@dataclass(slots=True)
class ThroughputModel:
    small: StepProfile
    large: StepProfile
    max_batch: int = 64
    shared_device: bool = False
    tau_grid: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 1.0, 2.0, 4.0])  # x large step time

    def predict(self, concurrency: int, large_share: float, tau: float = 0.0,
                catch_up: float | None = None, home_steps: float = 1.0, verify: bool = False) -> Prediction:
        """`catch_up`: tokens the large model computes per hand-off (default 1 / share, the tokens written
        since its last visit; the first visit of a request also prefills its prompt, so observed values run higher).
        `large_share`: large-model visits per output token; `home_steps`: home-model steps per output token;
        `verify`: the large model judges the catch-up (logits at every token; verify_inputs sets it)."""
        return self._solve(*self._timers(large_share, catch_up, verify), concurrency, large_share, tau, home_steps)

    def choose_tau(self, concurrency: int, large_share: float, max_tpot: float = 0.0,
                   catch_up: float | None = None, home_steps: float = 1.0, verify: bool = False) -> Prediction:
        """The tau of the grid with the best predicted throughput whose TPOT stays within `max_tpot` (if set)."""
        unit = self.large.step_time(1)
        timers = self._timers(large_share, catch_up, verify)
        options = [self._solve(*timers, concurrency, large_share, k * unit, home_steps) for k in self.tau_grid]
        allowed = [o for o in options if not max_tpot or o.tpot <= max_tpot] or options[:1]
        return max(allowed, key=lambda o: o.tokens_per_s)

    def _timers(self, large_share: float, catch_up: float | None, verify: bool):
        """(small step time by batch, large step time by batch at the catch-up's tokens per row, or None)."""
        p = min(max(large_share, 0.0), 1.0)
        catch_up = catch_up or (1.0 / p if p > 0 else 1.0)
        return self.small.timer(), self.large.timer(catch_up, verify) if p > 0 else None

    def _solve(self, small_time, large_time, concurrency: int, large_share: float, tau: float,
               home_steps: float) -> Prediction:
        """predict()'s fixed-point iteration."""
        h = max(home_steps, 1e-9)
        c, p = max(1, concurrency), min(max(large_share, 0.0), 1.0)
        n_s, b_l, u_s, u_l = float(c), 1.0, 1.0, 0.0
        others = (c - 1) / c  # NOTE: a request never waits for, or is slowed by, its own step at the other model
        shared, max_batch = self.shared_device, self.max_batch
        k_s, k_l, fc, eps = self.small.slowdown, self.large.slowdown, float(c), CONVERGED
        for i in range(MAX_ITERATIONS):
            # NOTE: min(a, b) and max(a, b) written out as CPython computes them (b if b < a else a; b if b > a else
            # a), since the runtime asks this at every tau choice, on the event loop
            s0 = small_time(max_batch if max_batch < n_s else n_s)
            if p > 0:
                b = 1.0 if 1.0 > b_l else b_l
                l0 = large_time(max_batch if max_batch < b else b)
            else:
                l0 = 0.0
            v_s, v_l = others * u_s, others * u_l  # the other model's utilisation by the other requests
            if shared:
                s, l = s0 + v_l * l0 / 2, l0 + v_s * s0 / 2
            else:
                s, l = s0 * (1 + k_s * v_l), l0 * (1 + k_l * v_s)
            w = tau / 2 + v_l * l / 2 if p > 0 else 0.0
            t = h * s + p * (w + l)
            x = c / t
            if shared:
                cap = 1 / (h * s0 / n_s + (p * l0 / max(b_l, 1.0) if p > 0 else 0.0))
                x = cap if cap < x else x
            queued = c / x / t  # NOTE: where the device caps x, requests queue for it in proportion to their time at each model
            n_s = x * h * s * queued
            n_s = n_s if n_s < fc else fc
            n_s = n_s if n_s > 1.0 else 1.0
            if p <= 0:
                b_l = 0.0
            else:
                if shared:  # hand-offs come only as home steps end: a large step takes those of the
                    q = min(1.0, p / h)  # home step before it (at least one) and those of its delay
                    b_l = n_s * q / (1 - (1 - q) ** n_s) + p * x * tau
                else:
                    b_l = 1 + p * x * (tau + l) * queued
                b_l = b_l if b_l < fc else fc
            u_s = x * h * s0 / n_s
            u_s = u_s if u_s < 1.0 else 1.0
            if p > 0:
                u_l = p * x * l0 / (b_l if b_l > 1.0 else 1.0)
                u_l = u_l if u_l < 1.0 else 1.0
            else:
                u_l = 0.0
            # stop at the fixed point: every quantity moved by at most CONVERGED of itself
            if i and not (abs(x - x1) > eps * abs(x1) or abs(n_s - n1) > eps * abs(n1) or abs(b_l - b1) > eps * abs(b1)
                          or abs(u_s - us1) > eps * abs(us1) or abs(u_l - ul1) > eps * abs(ul1)):
                break
            x1, n1, b1, us1, ul1 = x, n_s, b_l, u_s, u_l
        return Prediction(x, t, n_s, b_l, tau, u_l, u_s)


def verify_inputs(acceptance: float, drafts: float, route_step: bool = False) -> dict:
    """predict()'s inputs for a verifying policy: `acceptance` the share of judged drafts accepted (accepted /
    drafted; NOTE: not a per-position chance, which would give (1 - a^(m+1)) / (1 - a) tokens), `drafts` judged per visit,
    `route_step`: the home model ran a step to decide each send (`verify:of`; `verify:every` sends after its
    k-th draft without one)."""
    a, m = min(max(acceptance, 0.0), 1.0), max(drafts, 0.0)
    per_visit = 1 + a * m  # accepted drafts and the large model's token
    return {"large_share": 1 / per_visit, "catch_up": m + 1, "home_steps": (m + route_step) / per_visit, "verify": True}


def _monotone(table: dict[int, float]) -> dict[int, float]:
    """`table` made non-decreasing in its key: each entry at most every entry above it."""
    out, least = {}, float("inf")
    for key in sorted(table, reverse=True):
        least = min(least, table[key])
        out[key] = least
    return dict(sorted(out.items()))


def _curve(table: dict[int, float]) -> Callable[[float], float]:
    """The piecewise-linear curve through `table`'s points, extended linearly beyond its last key."""
    keys = sorted(table)
    return _line(keys, [table[k] for k in keys])


def _line(keys: list, values: list[float]) -> Callable[[float], float]:
    """The piecewise-linear curve through (keys[i], values[i]), keys ascending, extended linearly beyond the last."""
    keys, last = [float(k) for k in keys], len(keys)  # NOTE: floats compare and subtract faster than ints, alike
    # per bisect index i (keys[i - 1] < x <= keys[i]; beyond the table, i = len(keys): the last segment, extended):
    # (the segment's start, its value there, its rise, its run)
    segments = [None, *((keys[i - 1], values[i - 1], values[i] - values[i - 1], keys[i] - keys[i - 1])
                        for i in range(1, last))]
    if last > 1:
        segments.append((keys[-1], values[-1], values[-1] - values[-2], keys[-1] - keys[-2]))

    def at(x: float) -> float:
        i = bisect_left(keys, x)
        if i == 0:
            return values[0]
        lo, low, rise, run = segments[i]
        return low + rise * (x - lo) / run
    return at


def _interpolate(table: dict[int, float], x: float) -> float:
    return _curve(table)(x)


def profile_runner(runner, batches=BATCHES, chunks=CHUNKS, context: int = 32, repeat: int = 3) -> StepProfile:
    """Time the runner's steps. Every dummy sequence shares one block table (the first blocks of the
    pool), so the profile prefills `context` tokens once; run it before the engine serves."""
    table = list(range(-(-(context + max(chunks)) // runner.block_size)))
    runner.run([Chunk([1] * context, 0, table)])
    decode = {b: _best(runner, [Chunk([1], context, table)] * b, repeat) for b in batches}
    chunk = {n: _best(runner, [Chunk([1] * n, context, table)], repeat) for n in chunks}
    verify = {n: {b: _best(runner, [Chunk([1] * n, context, table, n)] * b, repeat) for b in VERIFY_BATCHES}
              for n in VERIFY_ROWS}
    return StepProfile(decode, chunk, verify=verify)


def decode_chunks(runner, batch: int, context: int = 32) -> list[Chunk]:
    """A decode step of `batch` dummy rows over one prefilled context (the first blocks of the pool)."""
    table = list(range(-(-(context + 1) // runner.block_size)))
    runner.run([Chunk([1] * context, 0, table)])
    return [Chunk([1], context, table)] * batch


def time_decode(runner, batch: int = 4, repeat: int = 3) -> float:
    return _best(runner, decode_chunks(runner, batch), repeat)


def measure_slowdown(executor, other, batch: int = 4) -> float:
    """How much `executor`'s decode step slows while `other` decodes at the same time, wherever the two
    workers live (threads of this process, processes, actors)."""
    alone = executor.call("time_decode", batch)
    other.call("spin_start", batch)
    try:
        together = executor.call("time_decode", batch)
    finally:
        other.call("spin_stop")
    return max(0.0, together / alone - 1)


def _best(runner, chunks: list, repeat: int) -> float:
    """The fastest of up to `repeat` steps after a warm-up one, each timed until its result is on the host, as
    the engine reads a step's (on a GPU, without the read a step would be timed at its launch only); fewer once
    the timed steps have taken ENOUGH_S seconds: a long step varies little from run to run, and the embedded
    1.5B's profile spent most of its 30 s repeating its longest steps."""
    runner.run(chunks)
    times = []
    while len(times) < repeat and (not times or _on_any_rank(runner, sum(times) < ENOUGH_S)):
        t = time.perf_counter()
        runner.run(chunks).logits[:1, :1].tolist()
        times.append(time.perf_counter() - t)
    return min(times)


def _on_any_rank(runner, flag: bool) -> bool:
    """`flag`, set where it is set on any rank of a tensor-parallel runner. NOTE: each step is a collective, so
    the ranks must agree on how many they run; each rank's own timings would have them differ."""
    tp = getattr(runner, "tp", None)
    return tp.any(flag) if tp is not None else flag


def load_or_profile(path: Path, make, pids: tuple[int, ...] = ()) -> StepProfile:
    """The cached profile, or `make()`'s, cached only if the machine was quiet while it was measured: other
    processes (not this one, not the workers' `pids`) used at most BUSY of its CPU time. NOTE: a profile taken
    beside other work is slow for good (the tau choice reads it at every start): a busy one serves this process
    only and is measured again at the next start."""
    from tokenrouter.models.kernels_timing import BUSY, cpu_sample, others_share

    if path.exists():
        return StepProfile.from_dict(json.loads(path.read_text()))
    before, workers = cpu_sample(), _cpu_seconds(pids)
    profile = make()
    busy = others_share(before, cpu_sample(), _cpu_seconds(pids) - workers)
    if busy is not None and busy > BUSY:
        log.warning("step profile not cached: other processes used %.0f%% of the CPU time while it was measured; "
                    "it is measured again at the next start", busy * 100)
        return profile
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(profile)))
    return profile


def _cpu_seconds(pids: tuple[int, ...]) -> float:
    """CPU seconds the processes `pids` have used (all their threads); 0 for those /proc cannot tell."""
    import os

    total, ticks = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in set(pids) - {os.getpid()}:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def profiled_model(config, executors: dict, dirs: dict[str, Path]) -> ThroughputModel:
    """The throughput model of a config's first and last model, from their workers' profiles (cached per
    machine and placement). Models on one device take turns on it; on different devices (or cores) they step
    in parallel and slow each other down by a measured factor."""
    import hashlib
    import os

    from tokenrouter.models.native import isa_limit, version
    from tokenrouter.models.sources import cache_dir

    names = [m.name for m in config.models]
    small, large = executors[names[0]], executors[names[-1]]
    shared = small.shares_device_with(large)
    profiles = []
    for executor, other in ((small, large), (large, small)):
        spec = config.model(executor.name)
        threads = executor.call("num_threads")  # what the worker steps on (torch_threads 0 is chosen per machine)
        # NOTE: TOKENROUTER_ISA=avx2 gives the models other kernels (what an AVX2 CPU runs), and a changed native
        # kernel other speeds: other step times
        key = f"v{PROFILE_VERSION}|{dirs[executor.name].resolve()}|{spec.dtype}|{spec.devices}|{threads}|" \
              f"{spec.block_size}|{os.cpu_count()}|{shared}|{config.placement}|{spec.cpus}|{version()}" + \
              (f"|isa={isa_limit()}" if isa_limit() else "")
        path = cache_dir() / "profiles" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"

        def make(executor=executor, other=other):
            from tokenrouter.bench.progress import step

            with step(f"profile {executor.name}'s steps (once per machine; the throughput model's step times)"):
                profile = StepProfile.from_dict(executor.call("profile"))
                if not shared:
                    profile.slowdown = measure_slowdown(executor, other)
            return profile

        profiles.append(load_or_profile(path, make, (small.info.pid, large.info.pid)))
    return ThroughputModel(*profiles, max_batch=config.scheduler.max_num_seqs, shared_device=shared)
