"""The load generator against an engine served over HTTP: the same tokens as in-process, client-side
latencies, Poisson arrivals, failures counted; and `bench serve --url` end to end."""
from __future__ import annotations

import asyncio
import json
import math

import pytest

import tokenrouter
from tokenrouter.bench.__main__ import main
from tokenrouter.bench.load import generate_load, measure_server

POLICY = "schedule:every=3"
PROMPTS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]


@pytest.fixture(scope="module")
def url(svc):
    with svc.serve_http(port=0) as http:
        yield http.url


@pytest.mark.parametrize("rate", [math.inf, 200.0])
def test_load_returns_the_engines_tokens_with_client_timings(svc, url, rate):
    with tokenrouter.connect(url) as remote:
        outs = asyncio.run(generate_load(remote, PROMPTS, POLICY, concurrency=3, max_tokens=9, request_rate=rate))
    for prompt, out in zip(PROMPTS, outs):
        ref = svc.generate(prompt, policy=POLICY, max_tokens=9)
        assert out.token_ids == ref.token_ids and [r.model for r in out.tokens] == [r.model for r in ref.tokens]
        times = [r.t for r in out.tokens]
        assert times == sorted(times) and 0 < out.metrics.ttft <= out.metrics.e2e


def test_measure_server_row(url):
    with tokenrouter.connect(url) as remote:
        row = measure_server(remote, PROMPTS, POLICY, concurrency=2, max_tokens=6)
    assert row["completed"] == len(PROMPTS) and row["failed"] == 0 and row["errors"] == []
    assert 0 < row["output_tokens"] <= 6 * len(PROMPTS)
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert 0 <= row[f"{name}_p50_ms"] <= row[f"{name}_p99_ms"]
    assert row["small_steps"] > 0 and row["large_steps"] > 0  # read from /metrics before and after


def test_failures_are_counted_not_raised(url):
    with tokenrouter.connect(url) as remote:
        row = measure_server(remote, PROMPTS[:3], POLICY, concurrency=2, max_tokens=5000)
    assert row["failed"] == 3 and row["completed"] == 0 and "max_tokens" in row["errors"][0]


def test_bench_serve_url_cli(url, tmp_path, capsys):
    out = tmp_path / "load.json"
    main(["serve", "--url", url, "--policy", POLICY, "--concurrency", "1,4", "--requests", "4", "--max-tokens", "5",
          "--request-rate", "100", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [r["concurrency"] for r in result["results"]] == [1, 4]
    assert all(r["completed"] == 4 for r in result["results"])
    assert "| C | tok/s |" in capsys.readouterr().out
