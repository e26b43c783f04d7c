"""Delayed batching swept: tau x concurrency, each point measured beside the throughput model's prediction.

    python -m tokenrouter.bench sweep --config config/embedded/qwen2.5-coder-0.5b_1.5b.yaml \\
        --policy random:share=0.15 --concurrency 4,16 --tau-ms 0,100,300,auto --json sweep.json

A verifying policy (`--policy verify:every=4`) is predicted from each point's measured acceptance rate and drafts
per visit (`svc.predict_verify`), and its rows add those and the tokens per large-model visit.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import tokenrouter
from tokenrouter.bench import checks, write_json
from tokenrouter.bench.machine import announce, machine
from tokenrouter.bench.serve import PROMPTS, check_workload, measure_engine

COLUMNS = ["concurrency", "tau_setting", "tau", "tokens_per_s", "predicted_tokens_per_s", "measured_over_predicted",
           "tpot_p50_ms", "predicted_tpot_ms", "ttft_p50_ms", "e2e_p99_ms", "large_share", "large_tokens_per_step",
           "busy_fraction", "acceptance_rate", "drafts_per_visit", "tokens_per_visit"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True)
    p.add_argument("--policy", default="random:share=0.15")
    p.add_argument("--concurrency", default="4,16")
    p.add_argument("--tau-ms", default="0,100,300,auto", help="comma-separated milliseconds; auto: the model chooses")
    p.add_argument("--requests", type=int, default=16, help="prompts per point")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--json", default="")


def parse_taus(text: str) -> list[float | None]:
    taus = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        if item == "auto":
            taus.append(None)
            continue
        try:
            taus.append(float(item))
        except ValueError:
            raise ValueError(f"--tau-ms: expected milliseconds or 'auto', got {item!r}") from None
        if taus[-1] < 0:
            raise ValueError(f"--tau-ms: must be >= 0, got {item!r}")
    return taus


def sweep_tau(svc, prompts: list, policy, concurrencies: list[int], taus_ms: list[float | None],
              max_tokens: int = 48, on_row: Callable[[dict], None] | None = None):
    """Measure every (concurrency, tau) point on the same prompts; tau None lets the throughput model choose.
    Returns a pandas DataFrame, one row per point; `on_row` sees each row as it lands (live plots)."""
    import pandas as pd

    ids = [svc.encode(p) if isinstance(p, str) else p for p in prompts]
    previous = svc.runtime.fixed_tau
    rows = []
    try:
        for c in concurrencies:
            for tau in taus_ms:
                svc.set_tau(None if tau is None else tau / 1e3)
                setting = "auto" if tau is None else f"{tau:g} ms"
                row, _ = measure_engine(svc, ids, policy, c, max_tokens, desc=f"C={c} tau {setting}")
                row["tau_setting"] = setting
                row["large_tokens_per_step"] = row.get(f"{svc.models[-1]}_tokens_per_step", 0.0)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    finally:
        svc.set_tau(previous)
    frame = pd.DataFrame(rows)
    return frame[[c for c in COLUMNS if c in frame] + [c for c in frame if c not in COLUMNS]]


def check_args(args: argparse.Namespace) -> None:
    """Every argument, before any model loads (raises ValueError naming the argument)."""
    checks.config(args.config)
    checks.policies([args.policy], "--policy")
    checks.levels(args.concurrency)
    if not parse_taus(args.tau_ms):
        raise ValueError(f"--tau-ms: give at least one value, got {args.tau_ms!r}")
    check_workload(args)


def run(args: argparse.Namespace) -> dict:
    taus = parse_taus(args.tau_ms)
    levels = checks.levels(args.concurrency)
    host = machine()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    with tokenrouter.serve(args.config) as svc:
        frame = sweep_tau(svc, prompts, svc.policy(args.policy), levels, taus, args.max_tokens,
                          on_row=lambda r: print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                                             for k, v in r.items() if k in COLUMNS}), flush=True))
    announce(host)
    print(frame[[c for c in COLUMNS if c in frame]].to_markdown(index=False, floatfmt=".2f"))
    result = {"config": args.config, "policy": args.policy, "requests": args.requests, "max_tokens": args.max_tokens,
              "machine": host, "results": frame.to_dict("records")}
    write_json(args.json, result)
    return result
