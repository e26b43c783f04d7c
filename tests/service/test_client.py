"""`tokenrouter.connect(url)` behaves as the in-process Service it fronts: same outputs, records, metrics
and stats; errors raise what the Service raises; leaving a stream early aborts the request."""
from __future__ import annotations

import asyncio
import threading

import pytest

import tokenrouter
from tokenrouter.engine.runtime import EngineOverloaded

POLICY = "schedule:every=3"


@pytest.fixture(scope="module")
def engine(serve_inprocess):
    with serve_inprocess() as (svc, http, server), tokenrouter.connect(http.url) as remote:
        yield svc, remote, server


@pytest.fixture
def pair(engine):
    return engine[:2]


def same(a, b):
    assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
    assert [r.model for r in a.tokens] == [r.model for r in b.tokens]
    assert a.prompt_tokens == b.prompt_tokens and a.policy == b.policy and a.models == b.models
    assert a.metrics.handoffs == b.metrics.handoffs and a.metrics.tokens_computed == b.metrics.tokens_computed
    assert a.metrics.tokens_per_model == b.metrics.tokens_per_model


@pytest.mark.parametrize("prompt, options", [
    ("hello there", {}),  # one user chat message
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], {}),
    ([5, 6, 7, 8, 9], {}),  # token ids
    ("raw text", {"raw": True}),
    ("stop me", {"stop": ("a", "e"), "max_tokens": 30}),
])
def test_generate_equals_in_process(pair, prompt, options):
    svc, remote = pair
    args = {"policy": POLICY, "max_tokens": 12, **options}
    same(remote.generate(prompt, **args), svc.generate(prompt, **args))


def test_policy_parameters_as_keywords(pair):
    svc, remote = pair
    same(remote.generate("hi", policy="schedule", every=2, max_tokens=9),
         svc.generate("hi", policy="schedule", every=2, max_tokens=9))


def test_stream_and_agenerate_equal_generate(pair):
    svc, remote = pair
    ref = svc.generate("stream me", policy=POLICY, max_tokens=14)

    async def run():
        stream = remote.stream("stream me", policy=POLICY, max_tokens=14)
        records = [r async for r in stream]
        return records, stream.output, await remote.agenerate("stream me", policy=POLICY, max_tokens=14)

    records, streamed, awaited = asyncio.run(run())
    assert [(r.token_id, r.model) for r in records] == [(r.token_id, r.model) for r in ref.tokens]
    same(streamed, ref)
    same(awaited, ref)


def test_leaving_a_stream_early_aborts(engine):
    svc, remote, server = engine

    async def take_two():
        stream = remote.stream("long", policy=POLICY, max_tokens=900, ignore_eos=True)
        async for record in stream:
            if record.model == "large":  # the third token: the request holds blocks in both models
                break
        await stream.aclose()

    before = svc.stats()["small"]["tokens"]
    asyncio.run(take_two())
    stats = server.wait_idle()
    assert stats["small"]["tokens"] - before < 600  # nowhere near the 900 tokens asked for


def test_generate_batch_in_order(pair):
    svc, remote = pair
    requests = ["a", {"prompt": "b", "max_tokens": 3}, [1, 2, 3], "d"]
    for a, b in zip(remote.generate_batch(requests, concurrency=3, policy=POLICY, max_tokens=6),
                    svc.generate_batch(requests, concurrency=3, policy=POLICY, max_tokens=6)):
        same(a, b)


def test_stats_and_models_mirror_the_service(pair):
    svc, remote = pair
    assert remote.models == svc.models
    assert remote.stats() == svc.stats()
    assert remote.error is None


def test_errors_raise_what_the_service_raises(pair):
    svc, remote = pair
    with pytest.raises(ValueError, match="^max_tokens"):
        remote.generate("x", max_tokens=0)
    with pytest.raises(ValueError, match="^policy"):
        remote.generate("x", policy="oracle")
    with pytest.raises(TypeError, match="policy"):
        remote.generate("x", policy=svc.policy(POLICY))

    async def bad_stream():
        return [r async for r in remote.stream("x", top_p=2.0)]

    with pytest.raises(ValueError, match="^top_p"):
        asyncio.run(bad_stream())


def test_batch_reports_refused_requests(serve_inprocess, stall):
    with serve_inprocess(scheduler={"max_queued_requests": 2}) as (svc, http, server):
        remote = tokenrouter.connect(http.url)
        result = {}
        with stall(svc):
            batch = threading.Thread(target=lambda: result.update(
                outs=remote.generate_batch(["p"] * 6, concurrency=6, max_tokens=4)))
            batch.start()
            refused = 'tokenrouter_requests_total{endpoint="/v1/chat/completions",outcome="503"}'
            server.wait_for(lambda: f"{refused} 4" in server.http.get("/metrics").text)
        batch.join(timeout=60)
        outs = result["outs"]
        assert sorted(o.finish_reason for o in outs) == ["error"] * 4 + ["length"] * 2
        assert all("overloaded" in o.error for o in outs if o.finish_reason == "error")
        with stall(svc):
            with server.http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}), \
                    server.http.stream("POST", "/v1/completions", json={"prompt": "y", "stream": True}):
                with pytest.raises(EngineOverloaded):
                    remote.generate("z")
        remote.close()


def test_connect_with_api_key(server):
    with tokenrouter.connect(server.url, api_key=server.api_key) as remote:
        out = remote.generate("hi", policy=POLICY, max_tokens=5)
        assert len(out.tokens) == 5 and out.metrics.tokens_per_model["large"] == 1
    with pytest.raises(PermissionError):
        tokenrouter.connect(server.url, api_key="wrong")
