"""A bounded load test on loopback: 64 concurrent streams, a quarter of them walking away at random points.
Every other stream must come back exactly as the same request run alone, no KV block may leak (read from
/metrics) and the server must stay healthy."""
from __future__ import annotations

import asyncio
import random

import httpx

from tokenrouter.service.client import sse_payloads
from tokenrouter.service.metrics import parse

STREAMS = 64
ROUTING = {"policy": "schedule", "every": 3}  # deterministic, and both models write tokens


def request(i: int) -> dict:
    return {"prompt": f"request {i}: " + "abcdefgh"[: i % 8], "max_tokens": 8 + i % 17, "routing": ROUTING}


async def stream(http: httpx.AsyncClient, body: dict, leave_after: int | None) -> list[tuple[int, str]] | None:
    """The (token id, model) pairs of one streamed request; None for a client that left early."""
    tokens = []
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        chunks = 0
        async for payload in sse_payloads(response.aiter_lines()):
            assert "error" not in payload, payload
            tokens += [(r["token_id"], r["model"]) for r in payload["choices"][0]["provenance"]]
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return None  # leaving the block closes the connection mid-stream
    return tokens


async def load(server, leavers: dict[int, int]) -> list:
    limits = httpx.Limits(max_connections=STREAMS + 8)
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, limits=limits, timeout=120) as http:
        return await asyncio.gather(*(stream(http, request(i), leavers.get(i)) for i in range(STREAMS)))


def test_concurrent_streams_with_disconnects(server):
    rng = random.Random(7)
    leavers = {i: rng.randint(1, 6) for i in rng.sample(range(STREAMS), STREAMS // 4)}
    results = asyncio.run(load(server, leavers))
    for i, tokens in enumerate(results):
        if i in leavers:
            continue
        alone = server.post("/v1/completions", request(i)).json()
        assert tokens == [(r["token_id"], r["model"]) for r in alone["choices"][0]["provenance"]], i
        assert {m for _, m in tokens} == {"small", "large"} or len(tokens) < 3
    stats = server.wait_idle()  # every block back in both models
    left = parse(server.http.get("/metrics").text).get(
        'tokenrouter_requests_total{endpoint="/v1/completions",outcome="499"}', 0)
    assert 0 < left <= len(leavers)  # the server saw them go (a leaver whose request ended first is not counted)
    assert all(stats[m]["waiting"] == stats[m]["running"] == stats[m]["parked"] == 0 for m in ("small", "large"))
    assert server.http.get("/health").json()["status"] == "ok"
