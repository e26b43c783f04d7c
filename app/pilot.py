"""Pilot results: a small sweep (policies x concurrency through `generate_batch`) or saved benchmark JSON
(`bench serve --json`, `bench quality --json`), as rows of that schema, one per policy and concurrency."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from app.pricing import can_price
from tokenrouter.bench import checks
from tokenrouter.bench.cost import prices, request_cost, run_cost, usage
from tokenrouter.bench.serve import PROMPTS, latencies, share

REQUIRED = ("concurrency", "tokens_per_s")
QUALITY_KEYS = ("pass@1", "pass_at_1")


def sweep(service, specs: list[str], levels: list[int], prompts: list[str], max_tokens: int,
          progress: Callable[[float, str], None] | None = None) -> dict:
    """Every policy at every concurrency level on the same prompts; each row also carries the mean cost per
    request and the priced busy time per completed request."""
    if not specs:
        raise ValueError("policies: give at least one policy")
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency: give levels >= 1, got {levels}")
    if not prompts:
        raise ValueError("prompts: give at least one prompt")
    rows, steps, priced = [], len(specs) * len(levels), can_price(service)
    for i, spec in enumerate(specs):
        for j, c in enumerate(levels):
            if progress:
                progress((i * len(levels) + j) / steps, f"{spec} at concurrency {c}")
            before, t = usage(service) if priced else None, time.perf_counter()
            outs = service.generate_batch(prompts, concurrency=c, policy=spec, max_tokens=max_tokens)
            wall, after = time.perf_counter() - t, usage(service) if priced else None
            tokens = sum(len(o.tokens) for o in outs)
            rows.append({"policy": spec, "concurrency": c, "output_tokens": tokens, "seconds": wall,
                         "tokens_per_s": tokens / wall, **latencies(outs),
                         "large_share": share(outs, service.models[-1]), **(costs(service, outs, before, after) if priced else {})})
    return {"source": "app sweep", "requests": len(prompts), "max_tokens": max_tokens, "results": rows}


def costs(service, outs: list, before: dict, after: dict) -> dict:
    """Mean dollars per request, and priced busy time per completed request, between two usage snapshots."""
    ok = [o for o in outs if not o.error]
    per_completed = run_cost(before, after, prices(service), len(ok)).per_completed_task
    return {"cost_per_request": sum(request_cost(o, service, after) for o in ok) / max(len(ok), 1),
            "cost_per_completed": per_completed}


def default_prompts(n: int) -> list[str]:
    if n < 1:
        raise ValueError(f"prompts: need at least 1, got {n}")
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def parse_levels(text: str) -> list[int]:
    return checks.levels(text, "concurrency")


def load_results(path: str | Path) -> list[dict]:
    """Rows from a saved JSON file: one `bench serve --json` result, a list of them, or a sweep saved by
    the app. A row without a policy takes its file's. Raises ValueError naming what is missing."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"results file: cannot read {Path(path).name}: {e}") from None
    runs = data if isinstance(data, list) else [data]
    rows = []
    for k, run in enumerate(runs):
        if not isinstance(run, dict) or not isinstance(run.get("results"), list):
            raise ValueError(f"results file: run {k} has no 'results' list (expected `bench serve --json` output)")
        for i, row in enumerate(run["results"]):
            missing = [key for key in REQUIRED if not isinstance(row.get(key), (int, float))]
            if missing:
                raise ValueError(f"results[{i}]: missing or non-numeric {', '.join(missing)}")
            rows.append({"policy": run.get("policy", f"run {k}"), **row})
    if not rows:
        raise ValueError("results file: no result rows")
    return rows


def quality(row: dict) -> float | None:
    """The row's pass@1, when the run measured quality."""
    return next((float(row[k]) for k in QUALITY_KEYS if isinstance(row.get(k), (int, float))), None)
