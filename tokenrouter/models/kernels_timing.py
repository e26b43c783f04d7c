"""Kernel timings that hold: each candidate's fastest of several repeats, taken with the machine's load measured
over them, and a timing set judged before it is cached: not taken while other work ran on the machine, and
consistent (a kernel does not get faster beyond noise when it is given more rows).

NOTE: on the 2-core machines here another process on one core makes a 2-thread GEMM wait for its descheduled
thread; such timings come out in multiples of the scheduler's tick (8 or 16 ms for a 0.2 ms projection), and
one cached once would have held for good.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch

REPEATS = 9  # repeats per candidate and batch size; the fastest counts (noise only ever adds time)
PRUNE = 4.0  # a candidate this much slower than the best at the first batch size is not timed further
BUSY = 0.15  # others' share of the machine's CPU time during a timing above which it does not count
ROW_SLACK = 1.25  # more rows may run this much faster than fewer before a timing set counts as inconsistent
NOISE_MS = 0.02  # and by this much in absolute terms (tiny shapes run in microseconds)
AGREE = 1.15  # two timings of one kernel within this factor of each other are the same figure


@dataclass(frozen=True, slots=True)
class CpuSample:
    wall: float  # seconds, monotonic
    busy: float  # CPU seconds the machine (or the cores sampled) spent outside idle (steal included) since boot
    own: float  # CPU seconds of this process, all its threads
    cpus: int  # cores counted in `busy`


def cpu_sample(cores: frozenset[int] | None = None) -> CpuSample | None:
    """The machine's (or only `cores`') and this process's CPU time now (None where /proc/stat cannot be read, e.g.
    macOS)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    per_cpu = [line.split() for line in lines[1:] if line.startswith("cpu") and line[3:4].isdigit()]
    counted = [lines[0].split()] if cores is None else [f for f in per_cpu if int(f[0][3:]) in cores]
    busy = sum(_busy_ticks([int(v) for v in f[1:]]) for f in counted) / os.sysconf("SC_CLK_TCK")
    cpus = len(per_cpu) if cores is None else len(counted)
    own = os.times()
    return CpuSample(time.monotonic(), busy, own.user + own.system, max(cpus, 1))


def _busy_ticks(fields: list[int]) -> int:
    # user nice system idle iowait irq softirq steal (guest is in user): all but idle and iowait
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields[:8]) - idle


def others_share(before: CpuSample | None, after: CpuSample | None, ours: float = 0.0) -> float | None:
    """The share of the machine's CPU time that other processes used between two samples (0 idle, 1 full);
    `ours`: CPU seconds of processes of our own (a worker's) to leave out as well."""
    if before is None or after is None or after.wall <= before.wall:
        return None
    others = (after.busy - before.busy) - (after.own - before.own) - ours
    return max(0.0, others / ((after.wall - before.wall) * after.cpus))


def loadavg() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


@dataclass(slots=True)
class Timing:
    """Ms per call of each candidate at each batch size, and the load it was taken under."""
    ms: dict[str, list[float]]
    others: float | None  # others' share of the CPUs during the timing (None: unknown on this system)
    loadavg: list[float] = field(default_factory=list)
    taken: str = ""  # UTC, ISO 8601

    @property
    def busy(self) -> bool:
        return self.others is not None and self.others > BUSY

    def problem(self) -> str:
        """Why this timing set must not be cached ('' when it may)."""
        if self.busy:
            return f"the machine was busy (other processes used {self.others:.0%} of its CPU time)"
        bad = non_monotonic(self.ms)
        return f"{', '.join(bad)} ran faster with more rows" if bad else ""

    def load(self) -> dict:
        return {"others": None if self.others is None else round(self.others, 3), "loadavg": self.loadavg}


def non_monotonic(ms: dict[str, list[float]]) -> list[str]:
    """Candidates whose time falls, beyond noise, as the batch grows."""
    return [name for name, t in ms.items() if any(b * ROW_SLACK + NOISE_MS < a for a, b in zip(t, t[1:]))]


def agree(first: dict[str, list[float]], second: dict[str, list[float]]) -> bool:
    """Two timing sets give every candidate they both timed fully the same figures within noise."""
    both = [n for n in first if n in second and len(first[n]) == len(second[n]) > 1]
    return bool(both) and all(max(a, b) <= AGREE * min(a, b) + NOISE_MS
                              for n in both for a, b in zip(first[n], second[n]))


def time_kernels(builds: list[dict], in_features: int, dtype: torch.dtype, batches: tuple[int, ...]) -> Timing:
    """Time one candidate at a time (its kernels for every given layer built, timed, then freed, so a shape's
    timing holds one candidate's copy of the weights besides the model's): the fastest of REPEATS calls at each
    batch size, each call cycling over the layers (as a decode step does, so no timing runs from cache). A
    candidate PRUNE times slower than the best at the first batch size is not timed further."""
    xs = [torch.randn(m, in_features, dtype=dtype) for m in batches]
    before = cpu_sample()
    ms: dict[str, list[float]] = {}
    for name in builds[0]:
        kernels = [b[name]() for b in builds]
        ms[name] = [_fastest_ms(kernels, xs[0])]
        if ms[name][0] <= PRUNE * min(t[0] for t in ms.values()):
            ms[name] += [_fastest_ms(kernels, x) for x in xs[1:]]
        del kernels
    best = min(t[0] for t in ms.values())
    ms = {n: (t if t[0] <= PRUNE * best else t[:1]) for n, t in ms.items()}
    share = others_share(before, cpu_sample())
    return Timing(ms, share, loadavg(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def _fastest_ms(kernels: list, x: torch.Tensor, repeat: int = REPEATS) -> float:
    with torch.inference_mode():
        for k in kernels:
            k(x)
        best = math.inf
        for _ in range(repeat):
            t = time.perf_counter()
            for k in kernels:
                k(x)
            best = min(best, (time.perf_counter() - t) / len(kernels))
    return best * 1e3
