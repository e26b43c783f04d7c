"""Driving streamed requests for the UI: one at a time, or several at once merged into one update stream.
Failures end a request with a message (see app.errors) instead of raising. Closing any of these update
streams (the Stop button, a closed page) closes the engine's stream beneath, which aborts the request and
frees its blocks in every model."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from app.errors import user_message
from app.live import LiveRequest
from app.pricing import dollars

REFRESH_S = 0.05  # the UI is redrawn at most this often while tokens arrive (and always at the end)
TICK_S = 0.5  # and this often while none arrives, so the elapsed time moves on during a long wait


async def run_stream(service, prompt: str, spec: str, request: LiveRequest, **sampling: Any) -> AsyncIterator[None]:
    """Stream one request into `request`, yielding after every token and once at the end; leaves the
    stream (aborting the request) once `request.stop()` was called."""
    stream = None
    try:
        stream = service.stream(prompt, policy=spec, **sampling)
        async for record in stream:
            request.add(record)
            yield
            if request.stopped:
                break
        else:
            output = getattr(stream, "output", None)
            request.finish(output, dollars(output, service))
        request.price_stopped(service)
    except Exception as e:  # noqa: BLE001 -- every failure becomes a message in the UI
        request.fail(user_message(e))
    finally:
        if stream is not None:
            await stream.aclose()
    yield


async def run_together(service, prompt: str, jobs: list[tuple[str, LiveRequest]],
                       **sampling: Any) -> AsyncIterator[None]:
    """Stream several (spec, request) pairs concurrently; yields whenever any of them advanced."""
    updates: asyncio.Queue[bool] = asyncio.Queue()

    async def drive(spec: str, request: LiveRequest) -> None:
        try:
            async for _ in run_stream(service, prompt, spec, request, **sampling):
                updates.put_nowait(False)
        finally:
            updates.put_nowait(True)

    tasks = [asyncio.create_task(drive(spec, request)) for spec, request in jobs]
    try:
        running = len(tasks)
        while running:
            running -= await updates.get()
            yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def throttled(updates: AsyncGenerator[None, None], tick: float = TICK_S) -> AsyncIterator[None]:
    """Pass on at most one update per REFRESH_S, always the last one, and one every `tick` seconds while
    none arrives. Closing it closes `updates`."""
    last, pending = 0.0, False
    waiting: asyncio.Future | None = None
    try:
        while True:
            waiting = waiting or asyncio.ensure_future(anext(updates))
            done, _ = await asyncio.wait({waiting}, timeout=tick)
            if not done:  # nothing new for a while: redraw anyway
                last = time.perf_counter()
                yield
                continue
            finished, waiting = waiting, None
            try:
                finished.result()
            except StopAsyncIteration:
                break
            pending = True
            if time.perf_counter() - last >= REFRESH_S:
                last, pending = time.perf_counter(), False
                yield
        if pending:
            yield
    finally:
        if waiting is not None:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        await updates.aclose()
