"""Load generator for a running server, in the manner of vLLM's serving benchmark: requests arrive as a
Poisson process (`--request-rate`, default: all at once) with at most `--concurrency` in flight; each is
streamed and timed at the client (TTFT, TPOT, ITL, E2E), failures are counted, not raised.

    python -m tokenrouter.bench serve --url http://127.0.0.1:30000 --policy schedule:every=4 \\
        --concurrency 1,8,32 --request-rate 4 --requests 64 --json load.json
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import time

import httpx
import numpy as np

import tokenrouter
from tokenrouter.bench import checks, progress, serve, write_json
from tokenrouter.bench.machine import describe, machine
from tokenrouter.service.client import RemoteService, read_stream
from tokenrouter.service.output import RequestMetrics, RoutedOutput


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options `bench serve` adds for a remote server (the prompt set, --policy, --concurrency,
    --requests, --max-tokens and --json are serve's own)."""
    p.add_argument("--url", default="", help="drive the server at this URL instead of starting an engine")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once, closed loop)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")


def check_args(args: argparse.Namespace) -> None:
    checks.above(args.request_rate, 0, "--request-rate")


def run(args: argparse.Namespace) -> dict:
    levels = checks.levels(args.concurrency)
    prompts = [serve.PROMPTS[i % len(serve.PROMPTS)] for i in range(args.requests)]
    rows, host = [], machine()
    with tokenrouter.connect(args.url, api_key=args.api_key) as remote:
        for c in levels:
            row = measure_server(remote, prompts, args.policy, c, args.max_tokens, args.request_rate, args.seed)
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    result = {"url": args.url, "policy": args.policy, "requests": args.requests, "max_tokens": args.max_tokens,
              "request_rate": args.request_rate, "client_machine": host, "results": rows}
    print("client " + describe(host))  # the server's machine may differ
    serve.print_table(rows)
    write_json(args.json, result)
    return result


def measure_server(remote: RemoteService, prompts: list, policy: str, concurrency: int, max_tokens: int,
                   request_rate: float = math.inf, seed: int = 0) -> dict:
    """One run of `prompts` against the server: the engine benchmark's row (throughput, latency percentiles,
    large-model share, step usage read from /metrics) plus request throughput and the failures."""
    before = remote.stats()
    t = time.perf_counter()
    outs = asyncio.run(generate_load(remote, prompts, policy, concurrency, max_tokens, request_rate, seed))
    wall = time.perf_counter() - t
    ok = [o for o in outs if not o.error]
    return {"concurrency": concurrency, "request_rate": request_rate, "completed": len(ok),
            "requests_per_s": len(ok) / wall, **serve.summarise([o.token_ids for o in outs], wall),
            **serve.latencies(outs), "large_share": serve.share(outs, remote.models[-1]),
            **serve.step_usage(before, remote.stats(), remote.models, wall),
            "errors": sorted({o.error for o in outs if o.error})[:5]}


async def generate_load(remote: RemoteService, prompts: list, policy: str, concurrency: int, max_tokens: int,
                        request_rate: float = math.inf, seed: int = 0) -> list[RoutedOutput]:
    """Stream every prompt, launched at Poisson arrival times, at most `concurrency` at once."""
    gaps = np.random.default_rng(seed).exponential(1 / request_rate, len(prompts)) if math.isfinite(request_rate) \
        else np.zeros(len(prompts))
    gate = asyncio.Semaphore(concurrency)
    bar = progress.Requests(len(prompts), f"server C={concurrency}")
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=remote.url, headers=remote.headers, limits=limits,
                                 timeout=httpx.Timeout(None, connect=30.0)) as http:
        async def one(prompt) -> RoutedOutput:
            async with gate:
                out = await timed_request(http, remote, prompt, policy, max_tokens)
            bar.done(len(out.tokens), bool(out.error))
            return out

        with bar:
            tasks = []
            for prompt, gap in zip(prompts, gaps):
                await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(one(prompt)))
            return await asyncio.gather(*tasks)


async def timed_request(http: httpx.AsyncClient, remote: RemoteService, prompt, policy: str,
                        max_tokens: int) -> RoutedOutput:
    """One streamed request; its records carry client-side times (seconds since it was sent), so the
    metrics are what a client sees. A failure comes back as finish_reason "error" with the reason."""
    path, body = remote.build_request(prompt, policy, max_tokens=max_tokens)
    start = time.perf_counter()
    records = []
    try:
        async with http.stream("POST", path, json={**body, "stream": True}) as response:
            async for item in read_stream(response):
                if isinstance(item, RoutedOutput):
                    e2e = time.perf_counter() - start
                    m = item.metrics
                    metrics = RequestMetrics.from_records(records, item.models, m.handoffs, m.tokens_computed, e2e)
                    return dataclasses.replace(item, tokens=records, metrics=metrics)
                records.append(dataclasses.replace(item, t=time.perf_counter() - start))
        raise RuntimeError("stream ended without a finish")
    except (httpx.HTTPError, ValueError, RuntimeError, TimeoutError) as e:
        metrics = RequestMetrics.from_records([], remote.models, 0, {}, time.perf_counter() - start)
        return RoutedOutput("", [], "error", 0, policy, remote.models, metrics, f"{type(e).__name__}: {e}")
