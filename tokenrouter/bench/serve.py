"""Routed serving: the engine against the lockstep and per-request baselines on identical prompts, and
against the throughput model's prediction.

    python -m tokenrouter.bench serve --config config/embedded/qwen2.5-coder-0.5b_1.5b.yaml \\
        --policy random:share=0.15 --concurrency 1,4,16 --baselines lockstep,per-request --json out.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

import tokenrouter
from tokenrouter.bench import checks, progress, write_json
from tokenrouter.bench.lockstep import generate_lockstep
from tokenrouter.bench.machine import announce, machine
from tokenrouter.bench.per_request import generate_one
from tokenrouter.policies import split_policy

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that reverses the words of a sentence.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a function that returns the n-th Fibonacci number iteratively.",
    "How do I read a CSV file with pandas and print its first rows?",
    "Write a Python class for a stack with push, pop and peek.",
    "What does the `yield` keyword do in Python?",
    "Write a function that merges two sorted lists into one sorted list.",
    "Write a SQL query that counts orders per customer.",
    "Write a bash one-liner that counts the lines of all .py files.",
    "Write a function that checks whether two strings are anagrams.",
    "Explain what a race condition is, with a short example.",
    "Write a binary search function in Python.",
    "Write a function that flattens a nested list.",
    "What is the time complexity of inserting into a Python dict?",
    "Write a decorator that times a function call.",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tokenrouter.bench import load

    p.add_argument("--config", default="", help="engine YAML (or --url: drive a running server)")
    p.add_argument("--policy", default="random:share=0.15")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--baselines", default="lockstep,per-request",
                   help="comma-separated from lockstep, per-request, all-large (the engine writing every token with "
                        "the large model); empty for none. Lockstep cannot run verifying policies and is skipped")
    p.add_argument("--requests", type=int, default=16, help="prompts per concurrency level")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--placement", default="local",
                   help="comma-separated placements to compare in one run (local, process, ray); under process "
                        "and ray, models without `cpus` in the config are pinned to cores of their own")
    p.add_argument("--tau-ms", type=float, default=-1.0,
                   help="fix the large model's delayed-batching tau (default: the throughput model chooses)")
    p.add_argument("--json", default="")
    p.add_argument("--record-trace", default="",
                   help="write the routing trace of the engine's run at the first concurrency level, with the models' "
                        "step profiles, for `bench simulate --trace` (docs/simulate.md)")
    p.add_argument("--step-trace", default="",
                   help="write every step of the engine's runs (not the baselines'), per model and concurrency "
                        "level: when it started, how long it took, its rows and the tokens it computed (JSON)")
    load.add_arguments(p)


def check_args(args: argparse.Namespace) -> None:
    """Every argument, before any model loads or request is sent (raises ValueError naming the argument)."""
    from tokenrouter.bench import load

    if bool(args.url) == bool(args.config):
        raise ValueError("--config, --url: give one of them (start an engine, or drive a running server)")
    if args.url:
        if args.step_trace:
            raise ValueError("--step-trace: the steps of a server driven with --url are not visible here; "
                             "run with --config")
        load.check_args(args)
        split_policy(args.policy)  # NOTE: built by the server, which may hold files (a router path) we lack
    else:
        checks.config(args.config)
        checks.policies([args.policy], "--policy")
        baselines(args.baselines)
        placements(args.placement)
    checks.levels(args.concurrency)
    check_workload(args)


def check_workload(args: argparse.Namespace) -> None:
    """The prompt-set options `serve` and `sweep` share."""
    checks.at_least(args.requests, 1, "--requests")
    checks.at_least(args.max_tokens, 1, "--max-tokens")


def baselines(text: str) -> list[str]:
    found = [b.strip() for b in text.split(",") if b.strip()]
    unknown = set(found) - {"lockstep", "per-request", "all-large"}
    if unknown:
        raise ValueError(f"--baselines: unknown {sorted(unknown)}; known: lockstep, per-request, all-large")
    return found


def placements(text: str) -> list[str]:
    from tokenrouter.config import PLACEMENTS

    found = [p.strip() for p in text.split(",") if p.strip()]
    unknown = set(found) - set(PLACEMENTS)
    if not found or unknown:
        raise ValueError(f"--placement: unknown {sorted(unknown)}; known: {', '.join(PLACEMENTS)}")
    if "ray" in found:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ValueError("--placement: ray needs the ray package (pip install -e '.[ray]')")
    return found


def pinned(config_path: str, placement: str) -> dict:
    """Config overrides for `placement`: under process and ray, every model without cores of its own gets an
    even share of this machine's cores (model i the i-th share), so that the models step side by side."""
    from tokenrouter.config import load_config

    overrides: dict = {"placement": placement}
    config = load_config(config_path)
    if placement == "local" or any(m.cpus for m in config.models):
        return overrides
    ranks = sum(m.tensor_parallel_size for m in config.models)
    per = (os.cpu_count() or 1) // ranks
    if per < 1:
        return overrides
    models, core = [], 0
    for m in config.models:
        n = per * m.tensor_parallel_size
        models.append({**dataclasses.asdict(m), "cpus": list(range(core, core + n))})
        core += n
    overrides["models"] = models
    return overrides


def run(args: argparse.Namespace) -> dict:
    from tokenrouter.bench import load

    if args.url:
        return load.run(args)
    rows, host = [], machine()
    steps: list[dict] | None = [] if args.step_trace else None
    for placement in placements(args.placement):
        rows.extend(measure_placement(args, placement, steps))
    result = {"config": args.config, "policy": args.policy, "requests": args.requests, "tau_ms": args.tau_ms,
              "max_tokens": args.max_tokens, "placement": args.placement, "machine": host, "results": rows}
    announce(host)
    print_table(rows)
    write_json(args.json, result)
    if steps is not None:
        write_json(args.step_trace, {**{k: v for k, v in result.items() if k != "results"},
                                     "columns": STEP_COLUMNS, "levels": steps})
        print(f"the engine's steps at {len(steps)} level(s) written to {args.step_trace}", file=sys.stderr)
    return result


def measure_placement(args: argparse.Namespace, placement: str, steps: list[dict] | None = None) -> list[dict]:
    """Every concurrency level on one placement: the engine, then each baseline on the same workers; with `steps`,
    each level's engine steps appended to it (steps_since)."""
    levels = checks.levels(args.concurrency)
    compared = baselines(args.baselines)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    rows = []
    # NOTE: the measured policy becomes the engine's default, so the engine is set up for it as a config naming it
    # would be (verify:every=k: the large model captures its verifying steps in CUDA graphs)
    name, params = split_policy(args.policy)
    with tokenrouter.serve(args.config, scheduler={"delay_tau_ms": args.tau_ms}, policy={"name": name, "params": params},
                           **pinned(args.config, placement)) as svc:
        policy = svc.policy(args.policy)
        requests = [svc.prepare(p, policy, max_tokens=args.max_tokens)[:2] for p in prompts]
        subs = svc.runtime.subservers
        executors = {m: subs[m].executor for m in svc.models}
        blocks = {m: subs[m].blocks for m in svc.models}
        per_request = None
        if policy.verifies and "lockstep" in compared:
            print(f"note: the lockstep baseline cannot run {policy.describe()} (it verifies drafts); skipped",
                  file=sys.stderr)
            compared = [b for b in compared if b != "lockstep"]
        for c in levels:
            before = {m: subs[m].stats.steps for m in svc.models}
            row, outs = measure_engine(svc, [ids for ids, _ in requests], policy, c, args.max_tokens)
            if steps is not None:
                steps.append({"placement": placement, "concurrency": c, **steps_since(svc, before)})
            if args.record_trace and c == levels[0]:
                record_trace(args.record_trace, svc, [ids for ids, _ in requests], outs, policy,
                             f"bench serve --config {args.config} --policy {args.policy} --max-tokens {args.max_tokens} "
                             f"--placement {placement}, C={c}", row)
            engine_ids = [o.token_ids for o in outs]
            if "all-large" in compared:
                large_row, large_outs = measure_engine(svc, [ids for ids, _ in requests], svc.policy("all-large"), c,
                                                       args.max_tokens, desc=f"all-large C={c}")
                row.update(all_large_tokens_per_s=large_row["tokens_per_s"],
                           over_all_large=row["tokens_per_s"] / large_row["tokens_per_s"],
                           all_large_identical=same(engine_ids, [o.token_ids for o in large_outs]),
                           all_large_ttft_p50_ms=large_row["ttft_p50_ms"],
                           all_large_tpot_p50_ms=large_row["tpot_p50_ms"])
            if "lockstep" in compared:
                t = time.perf_counter()
                usage: dict = {}
                with progress.Requests(len(requests), f"lockstep C={c}") as bar:
                    seqs = generate_lockstep(executors, blocks, svc.runtime.eos_ids, requests, policy, c, usage,
                                             on_finished=lambda s: bar.done(s.num_output_tokens))
                ls = summarise([s.output_ids for s in seqs], time.perf_counter() - t)
                for m, u in usage.items():
                    row.update({f"lockstep_{m}_{k}": v for k, v in u.items()})
                row.update(lockstep_tokens_per_s=ls["tokens_per_s"],
                           over_lockstep=row["tokens_per_s"] / ls["tokens_per_s"],
                           lockstep_identical=same(engine_ids, [s.output_ids for s in seqs]))
            if "per-request" in compared:
                if per_request is None:  # one request at a time: its rate does not depend on concurrency
                    t = time.perf_counter()
                    seqs = []
                    with progress.Requests(len(requests), "per-request loop") as bar:
                        for ids, params in requests:
                            seqs.append(generate_one(executors, blocks, svc.runtime.eos_ids, ids, params, policy))
                            bar.done(seqs[-1].num_output_tokens)
                    per_request = (summarise([s.output_ids for s in seqs], time.perf_counter() - t),
                                   [s.output_ids for s in seqs])
                row.update(per_request_tokens_per_s=per_request[0]["tokens_per_s"],
                           over_per_request=row["tokens_per_s"] / per_request[0]["tokens_per_s"],
                           per_request_identical=same(engine_ids, per_request[1]))
            row = {"placement": placement, "cpus": {m: svc.config.model(m).cpus for m in svc.models},
                   "shared_device": bool(svc.throughput_model and svc.throughput_model.shared_device), **row}
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return rows


STEP_COLUMNS = ["start_s", "seconds", "rows", "tokens"]


def steps_since(svc, before: dict[str, int]) -> dict:
    """Each model's steps after the step counts in `before`, as rows of STEP_COLUMNS: start in seconds from the
    run's first step (any model's), the step's time in the worker, its rows (sequences) and the tokens it computed
    (prefill and catch-up chunks count every token). The subservers keep their last STATS_WINDOW steps: `complete`
    says whether every step of the run is here."""
    subs = svc.runtime.subservers
    taken, complete = {}, True
    for m in svc.models:
        stats = subs[m].stats
        n = stats.steps - before[m]
        complete &= n <= len(stats.intervals)
        kept = min(n, len(stats.intervals))
        recent = zip(list(stats.intervals)[-kept:], list(stats.batch_sizes)[-kept:], list(stats.step_tokens)[-kept:])
        taken[m] = [(start, end - start, rows, tokens) for (start, end), rows, tokens in recent] if kept else []
    t0 = min((s[0][0] for s in taken.values() if s), default=0.0)
    return {"complete": complete,
            "steps": {m: [[round(start - t0, 6), round(sec, 6), rows, tokens] for start, sec, rows, tokens in s]
                      for m, s in taken.items()}}


def record_trace(path: str, svc, prompts: list[list[int]], outs: list, policy, source: str, row: dict) -> None:
    trace = trace_of(svc, prompts, outs, policy, source, row)
    trace.save(path)
    print(f"routing trace of {len(trace.requests)} requests written to {path}", file=sys.stderr)


def trace_of(svc, prompts: list[list[int]], outs: list, policy, source: str, row: dict):
    """The routing trace of a run (tokenrouter/simulate/traces.py), with this machine's step profiles of the models and
    the time each step of the run spent outside the forward pass (the worker's host work and the driver's; `row`:
    the run's measure_engine row)."""
    from tokenrouter.bench.machine import describe
    from tokenrouter.simulate.traces import from_outputs

    model = svc.throughput_model
    profiles = {svc.models[0]: dataclasses.asdict(model.small), svc.models[-1]: dataclasses.asdict(model.large)} \
        if model else {}
    overheads = {}
    if all(f"{m}_host_ms_per_step" in row for m in svc.models):  # `row` has the run's step usage (serve.step_usage)
        # NOTE: on one device, the time no model stepped (the thread hop to the device, the loop waking the readers)
        # is per-step cost too: spread evenly over the run's steps
        steps = sum(row[f"{m}_steps"] for m in svc.models)
        idle = max(0.0, row["seconds"] - sum(row[f"{m}_busy_s"] for m in svc.models)) / steps \
            if steps and model is not None and model.shared_device else 0.0
        overheads = {m: (row[f"{m}_host_ms_per_step"] + row[f"{m}_driver_ms_per_step"]) / 1e3 + idle
                     for m in svc.models}
    return from_outputs(prompts, outs, svc.models[-1], policy.describe(), source, describe(machine()), profiles,
                        policy.verifies, overheads)


def measure_engine(svc, prompts: list, policy, concurrency: int, max_tokens: int,
                   desc: str = "") -> tuple[dict, list]:
    """One closed-loop run of `prompts` through the engine at `concurrency`: throughput, latency percentiles,
    large-model share, step usage, and the throughput model's prediction at the tau the run ended with.
    `desc` labels its progress bar."""
    before = svc.stats()
    t = time.perf_counter()
    outs = progress.generate_batch(svc, [{"prompt": p} for p in prompts], concurrency, desc or f"engine C={concurrency}",
                                   policy=policy, max_tokens=max_tokens)
    wall = time.perf_counter() - t
    large = svc.runtime.subservers[svc.models[-1]]
    small = svc.runtime.subservers[svc.models[0]]
    row = {"concurrency": concurrency, **summarise([o.token_ids for o in outs], wall), **latencies(outs),
           "large_share": share(outs, svc.models[-1]), "tau": large.tau,
           **step_usage(before, svc.stats(), svc.models, wall),
           "both_stepping": both_stepping(small.stats.intervals, large.stats.intervals, t, t + wall) / wall}
    if len(svc.models) > 1:
        large_written = sum(o.metrics.tokens_per_model.get(svc.models[-1], 0) for o in outs)
        row["large_tokens_per_visit"] = row[f"{svc.models[-1]}_tokens"] / large_written if large_written else 0.0
        if policy.verifies:
            row.update(verification(outs, large_written))
            predicted = svc.predict_verify(concurrency, row["acceptance_rate"], row["drafts_per_visit"],
                                           tau=row["tau"], route_step=policy.every is None)
        else:
            predicted = svc.predict(concurrency, row["large_share"], tau=row["tau"],
                                    catch_up=row["large_tokens_per_visit"] or None)
        row.update(predicted_tokens_per_s=predicted.tokens_per_s, predicted_tpot_ms=predicted.tpot * 1e3,
                   measured_over_predicted=row["tokens_per_s"] / predicted.tokens_per_s)
    return row, outs


def verification(outs: list, visits: int) -> dict:
    """A verifying policy's drafts: judged, accepted, rolled back, and output tokens per large-model visit."""
    drafted = sum(o.metrics.drafted for o in outs)
    accepted = sum(o.metrics.accepted for o in outs)
    return {"drafted": drafted, "accepted": accepted, "rolled_back": drafted - accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "drafts_per_visit": drafted / visits if visits else 0.0,
            "tokens_per_visit": sum(len(o.tokens) for o in outs) / visits if visits else 0.0}


def both_stepping(a, b, t0: float, t1: float) -> float:
    """Seconds within [t0, t1] during which a step of `a` and a step of `b` ran at once ((start, end) pairs
    on one machine's clock)."""
    def union(intervals):
        out: list[list[float]] = []
        for start, end in sorted((max(s, t0), min(e, t1)) for s, e in intervals if e > t0 and s < t1):
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        return out

    total, ua, ub = 0.0, union(a), union(b)
    i = j = 0
    while i < len(ua) and j < len(ub):
        total += max(0.0, min(ua[i][1], ub[j][1]) - max(ua[i][0], ub[j][0]))
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarise(outputs: list[list[int]], wall: float) -> dict:
    tokens = sum(len(o) for o in outputs)
    return {"output_tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


def latencies(outs) -> dict:
    ok = [o for o in outs if not o.error]
    values = {"ttft": [o.metrics.ttft for o in ok], "tpot": [o.metrics.tpot for o in ok if len(o.tokens) > 1],
              "itl": [x for o in ok for x in o.metrics.itl], "e2e": [o.metrics.e2e for o in ok]}
    out = {"failed": len(outs) - len(ok)}
    for name, xs in values.items():
        for q in (50, 99):
            out[f"{name}_p{q}_ms"] = float(np.percentile(xs, q) * 1e3) if xs else float("nan")
    return out


def step_usage(before: dict, after: dict, models: list[str], wall: float) -> dict:
    """Per model: steps run, mean tokens per step and busy seconds during the run, and where a step's time goes:
    the forward pass and logits, the rest of the worker's step (host: inputs, policy, sampling), and the driver's
    scheduling and processing of the step on the event loop; and the share of the wall time some model was
    stepping (on one shared device, the rest is time the device sat idle)."""
    out = {}
    for m in models:
        steps = after[m]["steps"] - before[m]["steps"]
        out[f"{m}_steps"] = steps
        out[f"{m}_tokens"] = after[m]["tokens"] - before[m]["tokens"]
        out[f"{m}_tokens_per_step"] = out[f"{m}_tokens"] / steps if steps else 0.0
        out[f"{m}_busy_s"] = after[m]["busy_seconds"] - before[m]["busy_seconds"]
        if "forward_seconds" in after[m] and steps:
            forward = after[m]["forward_seconds"] - before[m]["forward_seconds"]
            out[f"{m}_forward_ms_per_step"] = forward / steps * 1e3
            out[f"{m}_host_ms_per_step"] = (out[f"{m}_busy_s"] - forward) / steps * 1e3
            out[f"{m}_driver_ms_per_step"] = (after[m]["driver_seconds"] - before[m]["driver_seconds"]) / steps * 1e3
    out["busy_fraction"] = sum(out[f"{m}_busy_s"] for m in models) / wall
    return out


def share(outs, model: str) -> float:
    total = sum(len(o.tokens) for o in outs)
    return sum(o.metrics.tokens_per_model.get(model, 0) for o in outs) / total if total else 0.0


def same(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def print_table(rows: list[dict]) -> None:
    print("\n| placement | C | tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms | E2E p50/p99 s "
          "| large share | both stepping | predicted tok/s | lockstep tok/s | vs lockstep | vs per-request "
          "| vs all-large | accepted | tokens per large visit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pred = f"{r['predicted_tokens_per_s']:.1f} ({r['measured_over_predicted']:.2f}x)" if "predicted_tokens_per_s" in r else "-"
        ls = f"{r['over_lockstep']:.2f}x ({r['lockstep_identical']} same)" if "over_lockstep" in r else "-"
        pr = f"{r['over_per_request']:.2f}x ({r['per_request_identical']} same)" if "over_per_request" in r else "-"
        lt = f"{r['lockstep_tokens_per_s']:.1f}" if "lockstep_tokens_per_s" in r else "-"
        al = f"{r['over_all_large']:.2f}x ({r['all_large_identical']} same)" if "over_all_large" in r else "-"
        acc = f"{r['acceptance_rate']:.0%} of {r['drafted']}" if "acceptance_rate" in r else "-"
        per_visit = f"{r['tokens_per_visit']:.2f}" if "tokens_per_visit" in r else "-"
        where = r.get("placement", "local") + ("" if not any(r.get("cpus", {}).values()) else
                                              " (" + ", ".join(f"{m}: {c}" for m, c in r["cpus"].items()) + ")")
        print(f"| {where} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} | "
              f"{r['tpot_p50_ms']:.0f}/{r['tpot_p99_ms']:.0f} | {r['itl_p50_ms']:.0f}/{r['itl_p99_ms']:.0f} | "
              f"{r['e2e_p50_ms'] / 1e3:.2f}/{r['e2e_p99_ms'] / 1e3:.2f} | {r['large_share']:.0%} | {r.get('both_stepping', 0):.0%} | {pred} | {lt} | {ls} | {pr} "
              f"| {al} | {acc} | {per_visit} |")
    print_step_times(rows)
    print_all_large(rows)


def print_all_large(rows: list[dict]) -> None:
    """The all-large baseline's latencies beside the engine's, per row that ran it: tokens/s over short answers mix
    the time to the first token (where a routed request may prefill on both models) with the time per token after."""
    for r in rows:
        if "all_large_ttft_p50_ms" in r and "all_large_tpot_p50_ms" in r:
            print(f"{r.get('placement', 'local')} C={r['concurrency']}, p50 TTFT / TPOT ms: engine "
                  f"{r['ttft_p50_ms']:.0f} / {r['tpot_p50_ms']:.1f}, all-large {r['all_large_ttft_p50_ms']:.0f} / "
                  f"{r['all_large_tpot_p50_ms']:.1f}")


def print_step_times(rows: list[dict]) -> None:
    """Where each model's step time went, per row: forward pass, the worker's host work, the driver's."""
    for r in rows:
        models = [k.removesuffix("_forward_ms_per_step") for k in r if k.endswith("_forward_ms_per_step")]
        parts = [f"{m} {r[f'{m}_forward_ms_per_step']:.2f} forward + {r[f'{m}_host_ms_per_step']:.2f} host + "
                 f"{r[f'{m}_driver_ms_per_step']:.2f} driver" for m in models]
        if parts:
            print(f"{r.get('placement', 'local')} C={r['concurrency']}, ms per step: {'; '.join(parts)}")
