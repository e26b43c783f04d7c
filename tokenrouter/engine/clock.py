"""The engine's clock, and the virtual one a simulation swaps in.

Everything in the driver that reads the time (a request's arrival, its token records, delayed batching, step
intervals) calls `now()`. On an ordinary event loop that is `time.perf_counter()`; on a `VirtualLoop` it is
the loop's own clock, which never waits: when no callback is ready, time jumps to the next timer. A
simulated worker's step is a `sleep` of its modelled latency, so a simulated hour of serving runs in the seconds
the driver's own work takes, and the same inputs give the same timeline every time.
"""
from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable
from asyncio.base_events import MAXIMUM_SELECT_TIMEOUT


def now() -> float:
    """Seconds on the running loop's virtual clock, else `time.perf_counter()` (off a loop too)."""
    loop = asyncio._get_running_loop()
    return loop.time() if isinstance(loop, VirtualLoop) else time.perf_counter()


def clock() -> Callable[[], float]:
    """`now`, bound to the running loop once (for a task that reads the time several times a step)."""
    loop = asyncio.get_running_loop()
    return loop.time if isinstance(loop, VirtualLoop) else time.perf_counter


async def sleep(seconds: float) -> None:
    """`asyncio.sleep(seconds)`; on a VirtualLoop where nothing else would run before it ends, the clock moves on at
    once instead (`VirtualLoop.skip`), without a timer and a future going round the loop."""
    loop = asyncio.get_running_loop()
    if not (isinstance(loop, VirtualLoop) and loop.skip(seconds)):
        await asyncio.sleep(seconds)


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
        loop = self.loop
        if len(self._fd_to_key) == loop._internal_fds:
            # NOTE: no I/O but the loop's own wake-up socket: another thread's call is queued before its byte is
            # written, so the ready queue tells what a look would, without a system call (the byte waits, as above)
            if not loop._ready:
                loop._virtual += timeout
            return []
        events = super().select(0)
        if not events:
            loop.advance(timeout)
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

    def skip(self, seconds: float) -> bool:
        """Move the clock on as `asyncio.sleep(seconds)` would, at once, if nothing else would run in between; False
        (the clock unmoved) if something might. NOTE: the same timeline as the sleep: with no callback ready and no
        other timer due by the sleep's end, the loop's next turn would move the clock by the timer's timeout (the same
        float sum as here) and resume the sleeper first. A call from another thread waits for the loop's next turn,
        as it would behind ready callbacks."""
        if self._ready or self._stopping or not 0 < seconds < MAXIMUM_SELECT_TIMEOUT:
            return False
        start = self._virtual
        when = start + seconds  # the sleep's timer (call_later)
        moved = start + (when - start)  # the clock after the selector's jump by the timeout
        due = moved + self._clock_resolution  # the loop runs the timers due before this
        if when >= due or (self._scheduled and self._scheduled[0]._when < due):
            return False
        self._virtual = moved
        return True
