"""The pilot report: token-level routing against query-level routing at a matched large-model share, and
all-small and all-large, on the same tasks, concurrency and engine; quality (pass@1 with executable checks),
cost per completed task and serving numbers (tokens/s, wall time, TTFT / TPOT / ITL) in one frame.

    python -m tokenrouter.bench pilot --config config/embedded/qwen2.5-coder-0.5b_1.5b.yaml --split heldout \\
        --token-policies confidence:threshold=0.9 --query-policies "query-random:share={share}" \\
        --concurrency 8 --json pilot.json --markdown pilot.md

A query-level spec containing `{share}` is run once per token-level policy, with `{share}` replaced by the
large-model token share that policy measured; specs without it run once as given, or, with
`--match-on-prompts`, once per token-level policy with the threshold that sends that share of these tasks'
prompts (set on the scores the router gives them, read from a run that sends nothing; no answer is read)."""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

import tokenrouter
from tokenrouter.bench import checks, write_json
from tokenrouter.bench.humaneval import MODES, PROJECT_TASKS, Task, load_tasks, request
from tokenrouter.bench.machine import announce, describe, machine
from tokenrouter.bench.progress import generate_batch
from tokenrouter.bench.quality import check_task_options, evaluate, split_policies
from tokenrouter.bench.sandbox import add_sandbox_argument, isolation
from tokenrouter.policies import make_policy, split_policy
from tokenrouter.policies.thresholds import threshold_for_share

BASELINES = ("all-small", "all-large")
TABLE = [("policy", "policy"), ("level", "level"), ("matched_to", "matched to"), ("pass@1", "pass@1"),
         ("failed", "failed"), ("cost_per_completed", "$ / completed task"), ("large_share", "large share"),
         ("activated_params", "active params / token"), ("tokens_per_s", "tok/s"), ("seconds", "wall s"),
         ("wall_vs_all_large", "wall vs all-large"), ("ttft", "TTFT p50/p99 ms"), ("tpot", "TPOT p50/p99 ms"),
         ("itl", "ITL p50/p99 ms")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True)
    p.add_argument("--tasks", default=str(PROJECT_TASKS), help="a HumanEval-format JSONL file")
    p.add_argument("--split", default="heldout", help="only tasks of this split; empty for all")
    p.add_argument("--token-policies", default="confidence:threshold=0.9", help="comma-separated token-level specs")
    p.add_argument("--query-policies", default="query-random:share={share}",
                   help="comma-separated query-level specs; {share} is matched to each token-level policy")
    p.add_argument("--match-on-prompts", action="store_true",
                   help="set each query-level spec without {share} to each token-level share on these prompts")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--mode", choices=MODES, default="chat")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per sandboxed test run")
    p.add_argument("--memory-mb", type=int, default=1024)
    add_sandbox_argument(p)
    p.add_argument("--json", default="")
    p.add_argument("--markdown", default="", help="write the table to this file")


def check_args(args: argparse.Namespace) -> None:
    """Every argument, before any model loads (raises ValueError naming the argument)."""
    checks.config(args.config)
    checks.tasks(args.tasks, args.split)
    check_levels(split_policies(args.token_policies), split_policies(args.query_policies), "--")
    check_task_options(args)


def check_levels(token_policies: list[str], query_policies: list[str], dashes: str = "") -> None:
    """Each spec built, and of its argument's level ("{share}" filled in)."""
    checks.policies(token_policies, f"{dashes}token-policies", "token")
    filled = []
    for spec in query_policies:
        try:
            filled.append(spec.format(share=0.5))
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"{dashes}query-policies: {spec!r}: only {{share}} may be filled in ({e!r})") from None
    checks.policies(filled, f"{dashes}query-policies", "query")


def run(args: argparse.Namespace) -> dict:
    tasks = load_tasks(args.tasks, args.split)
    sandbox = isolation(args.unsafe_no_sandbox)  # refuse before any model loads
    host = machine()
    with tokenrouter.serve(args.config) as svc:
        frame, rows = pilot(svc, tasks, split_policies(args.token_policies), split_policies(args.query_policies),
                            concurrency=args.concurrency, max_tokens=args.max_tokens, mode=args.mode,
                            match_on_prompts=args.match_on_prompts,
                            timeout=args.timeout, memory_mb=args.memory_mb, unsafe_no_sandbox=args.unsafe_no_sandbox,
                            progress=lambda row: print(json.dumps(_headline(row)), flush=True))
    table = markdown(frame)
    announce(host)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"{describe(host)}\n\n{table}\n")
    result = {"config": args.config, "tasks_file": args.tasks, "split": args.split, "num_tasks": len(tasks),
              "mode": args.mode, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
              "command": _command_line(), "machine": host, "sandbox": sandbox,
              "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "results": rows}
    write_json(args.json, result)
    return result


def pilot(svc, tasks: list[Task], token_policies: list[str], query_policies: list[str], concurrency: int = 8,
          progress: Callable[[dict], None] | None = None, match_on_prompts: bool = False,
          **evaluate_args) -> tuple[pd.DataFrame, list[dict]]:
    """Run the baselines, every token-level policy and its share-matched query-level policies; returns the
    report frame (one row per run, per-task results left out) and the full rows."""
    check_levels(token_policies, query_policies)
    rows: list[dict] = []

    def measure(spec: str, matched_to: str = "") -> dict:
        row = {**evaluate(svc, tasks, spec, concurrency=concurrency, **evaluate_args), "matched_to": matched_to}
        rows.append(row)
        if progress:
            progress(row)
        return row

    for spec in BASELINES:
        measure(spec)
    for spec in token_policies:
        token = measure(spec)
        for template in query_policies:
            if "{share}" in template:
                measure(template.format(share=f"{token['large_share']:.4f}"), matched_to=token["policy"])
            elif match_on_prompts:
                spec = matched_on_prompts(svc, tasks, template, token["large_share"], concurrency,
                                          evaluate_args.get("mode", "chat"))
                measure(spec, matched_to=token["policy"])
    for spec in (q for q in query_policies if "{share}" not in q and not match_on_prompts):
        measure(spec)
    return report_frame(rows), rows


def matched_on_prompts(svc, tasks: list[Task], spec: str, share: float, concurrency: int = 8,
                       mode: str = "chat") -> str:
    """`spec` (a query-level router) with the threshold that sends `share` of these tasks' prompts to the
    large model: each prompt's decision score is read from a run that sends nothing (the policy's first
    `decides_after` + 1 tokens), and only those scores set it."""
    name, params = split_policy(spec)
    probe = make_policy(name, **params)
    probe.threshold = math.inf  # score above inf: never sends, every record carries its score
    n = probe.decides_after
    outs = generate_batch(svc, [request(t, mode) for t in tasks], concurrency, f"{name} prompt scores",
                          policy=probe, max_tokens=n + 1)
    scores = torch.tensor([o.tokens[n].score if len(o.tokens) > n else -math.inf for o in outs])
    params = {k: v for k, v in params.items() if k not in ("threshold", "share")}
    params.update(probe.threshold_params(threshold_for_share(scores, share)))
    return name + ":" + ",".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def report_frame(rows: list[dict]) -> pd.DataFrame:
    """The report frame of result rows (an all-large row among them): per-task results left out, wall time
    relative to all-large added."""
    frame = pd.DataFrame([{k: v for k, v in r.items() if k not in ("tasks", "busy_seconds")} for r in rows])
    frame["wall_vs_all_large"] = frame["seconds"] / frame.loc[frame["policy"] == "all-large", "seconds"].iloc[0]
    return frame


def markdown(frame: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(title for _, title in TABLE) + " |", "|" + "---|" * len(TABLE)]
    for r in frame.to_dict("records"):
        lines.append("| " + " | ".join(_cell(r, key) for key, _ in TABLE) + " |")
    return "\n".join(lines)


def _cell(r: dict, key: str) -> str:
    if key in ("ttft", "tpot", "itl"):
        return f"{r[f'{key}_p50_ms']:.0f}/{r[f'{key}_p99_ms']:.0f}"
    if key == "pass@1":
        return f"{r['pass@1']:.1%} ({r['passed']}/{r['tasks_total']})"
    if key == "large_share":
        return f"{r[key]:.1%}"
    if key in ("cost_per_completed", "activated_params"):
        return f"{r[key]:.3g}"
    if key in ("tokens_per_s", "seconds"):
        return f"{r[key]:.1f}"
    if key == "wall_vs_all_large":
        return f"{r[key]:.2f}x"
    return str(r[key] or "-")


def _command_line() -> str:
    """The shell command of this run, when it came from `python -m tokenrouter.bench`."""
    if Path(sys.argv[0]).parts[-2:] != ("bench", "__main__.py"):
        return ""
    return shlex.join(["python", "-m", "tokenrouter.bench", *sys.argv[1:]])


def _headline(row: dict) -> dict:
    keys = ("policy", "matched_to", "pass@1", "failed", "cost_per_completed", "large_share", "tokens_per_s", "seconds")
    return {k: row[k] for k in keys}
