"""A device's thread: the one thread that runs the steps and control calls of its models, in order.

A step goes from the event loop to this thread and its result comes back once per step. `run_in_executor` on a
ThreadPoolExecutor made that round trip cost about 100 us (a work item, a concurrent Future and the callbacks that
chain it to an asyncio one); handing the loop's own future to the thread, which settles it with one
`call_soon_threadsafe`, costs 70-80 us, most of it the two wake-ups (a no-op's round trip, Intel Xeon, 2 cores,
2026-12-05). On a small model that is a few percent of each step, and on a GPU a share of the gap between steps.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

_STOP = None  # the queue's last item


class DeviceThread:
    """Runs `fn(*args)` one at a time on a thread of its own: `submit` for blocking callers (a concurrent Future),
    `run` for the event loop (an awaitable of the running loop). `initializer(*initargs)` runs on the thread
    first (e.g. its torch thread count); if it raises, every call fails with its error."""

    def __init__(self, name: str, initializer: Callable | None = None, initargs: tuple = ()):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, args=(initializer, initargs), name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._put((fn, args, future, None))
        return future

    def run(self, fn: Callable, *args) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._put((fn, args, future, loop))
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """No new calls; the queued ones run (cancel_futures: are cancelled instead), then the thread ends."""
        if not self._closed:
            self._closed = True
            if cancel_futures:
                self._cancel_queued()
            self._queue.put(_STOP)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _put(self, item) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name}: cannot run new calls after shutdown")
        self._queue.put(item)

    def _cancel_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                _fn, _args, future, loop = item
                if loop is None:
                    future.cancel()
                else:
                    _call_soon(loop, _settle, future, None, None, True)

    def _serve(self, initializer: Callable | None, initargs: tuple) -> None:
        failed: BaseException | None = None
        if initializer is not None:
            try:
                initializer(*initargs)
            except BaseException as e:  # noqa: BLE001 - handed to every caller below
                failed = e
        while (item := self._queue.get()) is not _STOP:
            fn, args, future, loop = item
            # NOTE: a loop's future is read from this thread only to skip a call nobody awaits any more (its task
            # was cancelled); one cancelled later is left alone by _settle
            cancelled = future.cancelled() if loop is not None else not future.set_running_or_notify_cancel()
            if cancelled:
                continue
            result, error = None, failed
            if error is None:
                try:
                    result = fn(*args)
                except BaseException as e:  # noqa: BLE001 - the caller's to handle
                    error = e
            if loop is not None:
                _call_soon(loop, _settle, future, result, error, False)
            elif error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)


def _call_soon(loop: asyncio.AbstractEventLoop, *args) -> None:
    try:
        loop.call_soon_threadsafe(*args)
    except RuntimeError:  # the loop has closed: nobody awaits the result any more
        pass


def _settle(future: asyncio.Future, result, error: BaseException | None, cancel: bool) -> None:
    # on the loop's thread; a future cancelled meanwhile (its awaiting task was) is left as it is
    if future.done():
        return
    if cancel:
        future.cancel()
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
