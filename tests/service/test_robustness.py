"""Overload, timeouts, clients that go away and a failing engine, on in-process engines served over HTTP.
`stall` holds the device's worker thread, so "no token can have come yet" is a fact, not a timing guess."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

LONG = {"prompt": "tell me everything", "max_tokens": 900, "ignore_eos": True,
        "routing": {"policy": "schedule", "every": 2}}  # both models hold blocks


def events(response: httpx.Response) -> list[dict | str]:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_queue_beyond_max_queued_requests_is_503(serve_inprocess, stall):
    with serve_inprocess(scheduler={"max_queued_requests": 2}) as (svc, _, server):
        body = {"prompt": "hi", "max_tokens": 4, "stream": True}
        with stall(svc):
            with server.http.stream("POST", "/v1/completions", json=body) as a, \
                    server.http.stream("POST", "/v1/completions", json=body) as b:
                assert a.status_code == b.status_code == 200  # both admitted, neither can step
                refused = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 4})
                assert refused.status_code == 503 and "overloaded" in refused.json()["error"]["message"]
                streamed = server.post("/v1/completions", body)
                assert streamed.status_code == 503
                assert svc.stats()["active_requests"] == 2
        server.wait_idle()
        assert server.post("/v1/completions", {"prompt": "hi", "max_tokens": 4}).status_code == 200


def test_request_timeout_aborts_and_frees(serve_inprocess, stall):
    with serve_inprocess(http_options={"request_timeout": 30}) as (svc, _, server):
        with stall(svc):
            late = server.post("/v1/completions", {**LONG, "request_timeout": 0.2})
            assert late.status_code == 504 and late.json()["error"]["param"] == "request_timeout"
            with server.http.stream("POST", "/v1/chat/completions",
                                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                          "stream": True, "request_timeout": 0.2}) as response:
                assert response.status_code == 200
                got = events(response)
            assert got[-1] == "[DONE]" and got[-2]["error"]["code"] == "request_timeout"
        server.wait_idle()
        metrics = server.http.get("/metrics").text
        assert 'endpoint="/v1/completions",outcome="504"' in metrics


def test_server_default_timeout_applies(serve_inprocess, stall):
    with serve_inprocess(http_options={"request_timeout": 0.2}) as (svc, _, server):
        with stall(svc):
            assert server.post("/v1/completions", LONG).status_code == 504
        server.wait_idle()


@pytest.mark.parametrize("stream", [True, False])
def test_client_going_away_aborts_the_request(serve_inprocess, stream):
    with serve_inprocess() as (svc, _, server):
        if stream:
            with server.http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
                for i, _ in enumerate(response.iter_lines()):
                    if i == 4:  # two events (each a data line and a blank line) and a half
                        break
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=0.5)
        stats = server.wait_idle()
        # aborted: nowhere near the 900 tokens the request asked for were computed
        assert stats["small"]["tokens"] < 600, stats


def test_failed_engine_fails_requests_fast_and_health_says_why(serve_inprocess, stall):
    with serve_inprocess() as (svc, _, server):
        def broken(chunks):
            raise RuntimeError("simulated device fault")

        svc.runtime.subservers["large"].executor.worker.runner.run = broken  # the first hand-off fails the engine
        result = {}
        waiting = threading.Thread(target=lambda: result.update(r=server.post("/v1/completions", LONG)))
        with server.http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
            with stall(svc):
                assert response.status_code == 200
                waiting.start()
                server.wait_for(lambda: svc.stats()["active_requests"] == 2)
            got = events(response)
        waiting.join(timeout=60)
        assert got[-1] == "[DONE]" and got[-2]["error"]["code"] == "engine_failed"
        assert "simulated device fault" in got[-2]["error"]["message"]
        assert result["r"].status_code == 503 and "simulated device fault" in result["r"].json()["error"]["message"]
        health = server.http.get("/health")
        assert health.status_code == 503 and "simulated device fault" in health.json()["error"]
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {**LONG, "stream": True})):
            refused = server.post(path, body)
            assert refused.status_code == 503 and "engine failed" in refused.json()["error"]["message"]
        stats = svc.stats()
        assert all(stats[m]["free_blocks"] == stats[m]["total_blocks"] for m in svc.models)
