"""Driving streams for the UI: the finished output and its cost, several streams at once, and failures
(engine busy, a lost server) ending a request with a message instead of an exception."""
from __future__ import annotations

import asyncio

import httpx
import pytest

import tokenrouter
from app.live import LiveRequest
from app.policies import resolve
from app.render import metrics_html
from app.stream import run_stream, run_together, throttled
from tests.app.conftest import BOTH_MODELS, PAIR

MODELS = ["small", "large"]


def live(spec: str) -> tuple[str, LiveRequest]:
    spec, policy = resolve(spec)
    return spec, LiveRequest(MODELS, policy)


async def drain(updates) -> int:
    return sum([1 async for _ in updates])


def test_a_finished_stream_carries_the_engine_output_and_its_cost(svc):
    spec, request = live(BOTH_MODELS)
    updates = asyncio.run(drain(run_stream(svc, "hello", spec, request, max_tokens=10)))
    assert updates == 11  # one per token, one at the end
    out = request.output
    assert out.token_ids == [r.token_id for r in request.records] and out.finish_reason == "length"
    assert out.metrics.tokens_computed["small"] > 0 and out.metrics.handoffs == request.handoffs == 5
    assert request.cost > 0 and request.summary()["finish"] == "length"


def test_live_hand_offs_count_tokens_away_from_home_until_the_engine_reports(svc):
    spec, request = live("schedule:every=3")

    async def partial():
        async for _ in run_stream(svc, "hello", spec, request, max_tokens=30):
            if len(request.records) == 9:
                return request.handoffs

    assert asyncio.run(partial()) == 3


def test_two_streams_at_once_both_finish(svc):
    jobs = [live("all-small"), live(BOTH_MODELS)]
    asyncio.run(drain(run_together(svc, "hello", jobs, max_tokens=8)))
    (_, small), (_, both) = jobs
    assert {r.model for r in small.records} == {"small"} and len(small.records) == 8
    assert {r.model for r in both.records} == {"small", "large"} and len(both.records) == 8
    assert small.output and both.output and not small.error and not both.error


def test_leaving_side_by_side_early_aborts_both_requests(svc):
    jobs = [live(BOTH_MODELS), live(BOTH_MODELS)]

    async def leave_early():
        updates = run_together(svc, "hello", jobs, max_tokens=500, ignore_eos=True)
        async for _ in updates:
            if sum(len(r.records) for _, r in jobs) >= 6:
                break
        await updates.aclose()

    asyncio.run(leave_early())
    svc.generate("hi", max_tokens=2)  # one more request passes step boundaries in both subservers
    svc.generate("hi", policy="all-large", max_tokens=2)
    stats = svc.stats()
    assert stats["active_requests"] == 0
    assert all(stats[m]["free_blocks"] == stats[m]["total_blocks"] for m in MODELS)


def test_throttled_always_passes_the_last_update():
    async def burst():
        for _ in range(100):
            yield

    assert 1 <= asyncio.run(drain(throttled(burst()))) < 100


def test_a_busy_engine_is_a_message():
    with tokenrouter.serve(PAIR, scheduler={"max_queued_requests": 1}) as busy:
        spec, first = live(BOTH_MODELS)
        _, second = live(BOTH_MODELS)

        async def two():
            async for _ in run_stream(busy, "hello", spec, first, max_tokens=900, ignore_eos=True):
                if first.records:  # the first request is in flight: the engine is full
                    await drain(run_stream(busy, "hello", spec, second, max_tokens=4))
                    return

        asyncio.run(two())
    assert second.error.startswith("Engine busy") and "max_queued_requests=1" in second.error
    assert "Engine busy" in metrics_html(second) and second.summary()["finish"] == "error"


class LostServer:
    """A remote service whose connection drops after the first token."""
    models = MODELS

    def __init__(self, svc):
        self.svc = svc

    async def stream(self, prompt, policy=None, **kwargs):
        async for record in self.svc.stream(prompt, policy=policy, **kwargs):
            yield record
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


@pytest.mark.parametrize("error, expected", [
    (httpx.ConnectError("[Errno 111] Connection refused"), "Lost the server"),
    (httpx.HTTPStatusError("503", request=httpx.Request("POST", "http://x"), response=httpx.Response(503)),
     "Engine busy"),
])
def test_a_lost_or_refusing_server_is_a_message(error, expected):
    class Refusing:
        models = MODELS

        async def stream(self, prompt, policy=None, **kwargs):
            raise error
            yield  # an async generator, as the client's stream is

    spec, request = live(BOTH_MODELS)
    asyncio.run(drain(run_stream(Refusing(), "hello", spec, request, max_tokens=4)))
    assert request.error.startswith(expected) and request.output is None


def test_a_server_lost_mid_stream_keeps_the_tokens_shown(svc):
    spec, request = live(BOTH_MODELS)
    asyncio.run(drain(run_stream(LostServer(svc), "hello", spec, request, max_tokens=50)))
    assert len(request.records) == 1 and request.error.startswith("Lost the server")


def test_stop_leaves_the_stream_aborts_and_frees_every_block(svc):
    spec, request = live(BOTH_MODELS)

    async def stop_after_three():
        async for _ in run_stream(svc, "hello", spec, request, max_tokens=900, ignore_eos=True):
            if len(request.records) == 3:
                request.stop()

    asyncio.run(stop_after_three())
    assert len(request.records) == 3 and request.output is None and request.summary()["finish"] == "stopped"
    assert "stopped" in metrics_html(request) and "latency" in metrics_html(request)
    svc.generate("hi", max_tokens=2)  # one more request passes step boundaries in both subservers
    svc.generate("hi", policy="all-large", max_tokens=2)
    stats = svc.stats()
    assert stats["active_requests"] == 0
    assert all(stats[m]["free_blocks"] == stats[m]["total_blocks"] for m in MODELS)


def test_stopping_a_finished_request_keeps_its_finish(svc):
    spec, request = live(BOTH_MODELS)
    asyncio.run(drain(run_stream(svc, "hello", spec, request, max_tokens=4)))
    request.stop()
    assert request.summary()["finish"] == "length" and not request.stopped


def test_throttled_ticks_while_no_update_arrives():
    gate = asyncio.Event()

    async def slow():
        yield
        await gate.wait()  # nothing arrives until the reader has seen three ticks
        yield

    async def read() -> int:
        seen = 0
        async for _ in throttled(slow(), tick=0.01):
            seen += 1
            if seen == 3:
                gate.set()
        return seen

    assert asyncio.run(read()) >= 4


def test_closing_throttled_closes_the_stream_beneath():
    closed = []

    async def endless():
        try:
            while True:
                yield
                await asyncio.sleep(0)
        finally:
            closed.append(True)

    async def leave():
        updates = throttled(endless(), tick=0.01)
        async for _ in updates:
            break
        await updates.aclose()

    asyncio.run(leave())
    assert closed == [True]


def test_the_elapsed_time_shows_while_running_and_the_latency_after(svc):
    spec, request = live(BOTH_MODELS)
    assert "elapsed" in metrics_html(request) and "running" in metrics_html(request)
    asyncio.run(drain(run_stream(svc, "hello", spec, request, max_tokens=3)))
    assert "latency" in metrics_html(request) and "elapsed" not in metrics_html(request)
