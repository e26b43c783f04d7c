"""CPU threads that follow the machine's load: a device thread steps on fewer torch threads while other processes
keep cores busy, and on all of its threads again once they stop.

NOTE: every torch op on n threads ends at a barrier that waits for all n. On a 2-core machine beside one busy
process (a browser tab, a build), the thread the system took off its core holds every op of a decode step for a
scheduler tick: the default pair's 0.5B model stepped in 122-136 ms on two threads against 41-70 ms on one, and
25 ms on two threads when idle (Intel Xeon, 2 cores, 2026-12-05, docs/placement.md). So a device thread counts
the cores other processes used over the last quarter second and leaves them that many threads.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import torch

from tokenrouter.models.kernels_timing import CpuSample, cpu_sample, others_share

PERIOD_S = 0.25  # how often a device thread re-reads the machine's load (at a step's start, never between)
_local = threading.local()


def threads_for(others: float, ceiling: int, cores: int) -> int:
    """Threads to step on when other processes kept `others` cores busy: the cores they left, at most `ceiling`,
    at least one. A core counts as taken from half of its time on (a barrier stalls on a core shared even part
    of the time)."""
    return max(1, min(ceiling, cores - int(others + 0.5)))


class LoadThreads:
    """The torch thread count of one device thread: `ceiling` (what placement chose) while the cores are free,
    fewer while other processes use them. `follow()` at each step's start, on that thread."""

    def __init__(self, ceiling: int, cores: frozenset[int] | None = None,
                 sample: Callable[[frozenset[int]], CpuSample | None] = cpu_sample,
                 clock: Callable[[], float] = time.monotonic):
        """`sample`, `clock`: the machine's CPU times and the clock of their `wall` (tests pass a fake machine's)."""
        self.ceiling = max(1, ceiling)
        self.cores = cores if cores is not None else frozenset(os.sched_getaffinity(0))
        self.sample, self.clock = sample, clock
        self.last = sample(self.cores)
        self.threads = self.ceiling
        self.changes = 0  # how often the count moved (tests, stats)

    def follow(self) -> int:
        """Re-read the load once PERIOD_S has passed since the last reading; set and return the thread count."""
        # NOTE: the clock first: reading /proc/stat at every step cost a tiny model's step 4% of its time
        if self.last is None or self.clock() - self.last.wall < PERIOD_S:
            return self.threads
        now = self.sample(self.cores)
        if now is None:
            return self.threads
        # NOTE: this process's own time (the driver's event loop and this device thread) is not others' load
        others = others_share(self.last, now) * now.cpus
        self.last = now
        threads = threads_for(others, self.ceiling, now.cpus)
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads, self.changes = threads, self.changes + 1
        return threads


def use_threads(n: int, follow_load: bool = True) -> None:
    """Run this thread's torch ops on n threads, fewer while other processes load the cores (`follow`).
    NOTE: torch applies its process-wide thread count to a thread at the thread's first op; until then a later
    torch.set_num_threads anywhere (a caller's restore) would win, so the first op happens here, after setting it."""
    torch.set_num_threads(n)
    torch.get_num_threads()
    enabled = follow_load and os.environ.get("TOKENROUTER_FOLLOW_LOAD", "1") != "0"
    _local.threads = LoadThreads(n) if enabled else None


def follow() -> int | None:
    """At a step's start on a device thread: follow the load (None where this thread does not: not a CPU device
    thread, or following is off)."""
    threads = getattr(_local, "threads", None)
    return threads.follow() if threads is not None else None
