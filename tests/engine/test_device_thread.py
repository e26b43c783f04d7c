"""A device's thread runs calls in order, for blocking callers and the event loop, and hands back their errors."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import CancelledError

import pytest

from tokenrouter.engine.device_thread import DeviceThread


def test_calls_run_in_order_on_one_thread_for_both_kinds_of_caller():
    thread = DeviceThread("t")
    seen = []

    def note(x):
        seen.append((x, threading.current_thread().name))
        return x * 2

    async def from_loop():
        return await asyncio.gather(*(thread.run(note, i) for i in range(5)))

    try:
        assert thread.submit(note, -1).result() == -2
        assert asyncio.run(from_loop()) == [0, 2, 4, 6, 8]
        assert [x for x, _ in seen] == [-1, 0, 1, 2, 3, 4]
        assert {name for _, name in seen} == {"t"}
    finally:
        thread.shutdown()


def test_errors_reach_the_caller_and_the_thread_goes_on():
    thread = DeviceThread("t")

    def fail():
        raise ValueError("bad step")

    async def from_loop():
        with pytest.raises(ValueError, match="bad step"):
            await thread.run(fail)
        return await thread.run(lambda: "still here")

    try:
        with pytest.raises(ValueError, match="bad step"):
            thread.submit(fail).result()
        assert asyncio.run(from_loop()) == "still here"
    finally:
        thread.shutdown()


def test_a_failed_initializer_fails_every_call():
    def init():
        raise RuntimeError("no device")

    thread = DeviceThread("t", init)
    try:
        with pytest.raises(RuntimeError, match="no device"):
            thread.submit(lambda: 1).result()
    finally:
        thread.shutdown()


def test_shutdown_cancels_what_waits_and_refuses_new_calls():
    thread = DeviceThread("t")
    gate, started = threading.Event(), threading.Event()

    def hold():
        started.set()
        return gate.wait()

    running = thread.submit(hold)
    started.wait()
    waiting = thread.submit(lambda: "never")
    thread.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert running.result() is True
    with pytest.raises(CancelledError):
        waiting.result()
    with pytest.raises(RuntimeError, match="after shutdown"):
        thread.submit(lambda: 1)
    thread.shutdown()  # again: a no-op that waits for the thread


def test_a_cancelled_await_is_skipped_and_a_closed_loop_does_not_stop_the_thread():
    thread = DeviceThread("t")
    gate, ran = threading.Event(), []

    async def cancel_one():
        blocker = thread.run(gate.wait)
        skipped = asyncio.ensure_future(thread.run(ran.append, "skipped"))
        await asyncio.sleep(0)
        skipped.cancel()
        gate.set()
        await blocker
        return await thread.run(ran.append, "ran")

    asyncio.run(cancel_one())
    assert ran == ["ran"]

    async def leave_a_call_behind():
        gate.clear()
        thread.run(gate.wait)  # its loop closes before the result comes back

    asyncio.run(leave_a_call_behind())
    gate.set()
    assert thread.submit(lambda: "alive").result() == "alive"
    thread.shutdown()
