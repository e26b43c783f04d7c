"""The engine's clock, and the virtual one a simulation swaps in.

Everything in the driver that reads the time (a request's arrival, its token records, delayed batching, step
intervals) calls `now()`. On an ordinary event loop that is `time.perf_counter()`; on a `VirtualLoop` it is
the loop's own clock, which never waits: when no callback is ready, time jumps to the next timer. A
simulated worker's step is an `asyncio.sleep` of its modelled latency, so a simulated hour of serving runs
in the seconds the driver's own work takes, and the same inputs give the same timeline every time.
"""
from __future__ import annotations

import asyncio
import selectors
import time


def now() -> float:
    """Seconds on the running loop's virtual clock, else `time.perf_counter()` (off a loop too)."""
    loop = asyncio._get_running_loop()
    return loop.time() if isinstance(loop, VirtualLoop) else time.perf_counter()


class _JumpingSelector(selectors.DefaultSelector):
    """A selector that, asked to wait for `timeout` seconds, looks once for ready I/O (a call from another
    thread) and otherwise moves its loop's clock on by `timeout` instead of sleeping."""

    def __init__(self):
        super().__init__()
        self.loop: VirtualLoop | None = None

    def select(self, timeout=None):
        if timeout is None:  # nothing scheduled: wait for another thread
            return super().select(timeout)
        if timeout <= 0:  # NOTE: callbacks are ready: run them first (another thread's call is queued already; only
            return []  # its wake-up byte waits, until the clock next moves or the loop waits)
        events = super().select(0)
        if not events:
            self.loop.advance(timeout)
        return events


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time, starting at 0. NOTE: deterministic as long as nothing from another thread
    arrives while it runs (a simulation submits its whole workload as one coroutine on the loop)."""

    def __init__(self):
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self._virtual = 0.0

    def time(self) -> float:
        return self._virtual

    def advance(self, seconds: float) -> None:
        self._virtual += seconds
