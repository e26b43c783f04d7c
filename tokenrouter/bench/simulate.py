"""Simulated serving: the engine's own scheduler, runtime and delayed batching on a virtual clock, with step
times from a device preset or measured tables, replaying a routing trace; the same report as `bench serve`,
every figure simulated, and the query-level router at the same large share beside it.

    python -m tokenrouter.bench simulate --config config/r2r/Qwen3-0.6B_Qwen3-32B.yaml --device h100 \\
        --workload reasoning --share 0.15 --concurrency 1,4,16,64,256 --baselines lockstep,all-large,query
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from tokenrouter.bench import checks, serve, write_json

BASELINES = ("lockstep", "per-request", "all-large", "all-small", "query")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tokenrouter.simulate.traces import PRESETS

    p.add_argument("--config", required=True, help="engine YAML: the models, their devices and the scheduler")
    p.add_argument("--trace", default="", help="a recorded routing trace (bench serve --record-trace); "
                                               "default: a synthetic one from --workload")
    p.add_argument("--workload", default="reasoning", help=f"synthetic trace preset: {', '.join(PRESETS)}")
    p.add_argument("--requests", type=int, default=64, help="synthetic trace: requests per concurrency level")
    p.add_argument("--share", type=float, default=0.15, help="synthetic trace: share of tokens sent to the large model")
    p.add_argument("--burst", type=float, default=0.0,
                   help="synthetic trace: mean length of a run of sends (0: independent sends)")
    p.add_argument("--seed", type=int, default=0, help="synthetic trace: seed of lengths and sends")
    p.add_argument("--latency", default="roofline", help="step times: roofline (a device preset) or profiled "
                                                         "(--profile, or the engine profiles a recorded trace carries)")
    p.add_argument("--device", default="h200", help="the GPU every cuda device of the config stands for: h200, h100, "
                                                    "a100-80g (roofline), and where --profile is not given")
    p.add_argument("--profile", default="", help="--latency profiled: h200 (CUDA-graph steps), h200-eager, or a "
                                                 "`bench runner --json` CUDA table")
    p.add_argument("--kv-efficiency", type=float, default=0.0,
                   help="share of peak bandwidth attention reads the KV cache at (default: the H200 fit's, measured "
                        "with the gathering torch backend; about 0.8 models in-place paged attention)")
    p.add_argument("--placement", default="", help="override the config's placement: local (models on one GPU take "
                                                   "turns), process (they step at once, slowed by contention)")
    p.add_argument("--network", default="", help="the link between the models' nodes (nvlink, roce-3.7, ib-400); "
                                                 "default: one node")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--baselines", default="lockstep,all-large,query",
                   help=f"comma-separated from {', '.join(BASELINES)}; empty for none")
    p.add_argument("--tau-ms", type=float, default=-1.0, help="fix the delayed-batching tau (default: chosen online)")
    p.add_argument("--record-trace", default="", help="write the (synthetic) trace simulated here")
    p.add_argument("--calibrate", action="store_true",
                   help="check the simulation against real runs: the shipped H200 routed runs (profiled H200 eager "
                        "steps), and, for a CPU --config, a real run on this machine replayed from its recorded trace")
    p.add_argument("--policy", default="random:share=0.15", help="--calibrate: the policy of the real run")
    p.add_argument("--max-tokens", type=int, default=48, help="--calibrate: max_tokens of the real run")
    p.add_argument("--json", default="")


def check_args(args: argparse.Namespace) -> None:
    from tokenrouter.simulate.devices import device, network
    from tokenrouter.simulate.traces import PRESETS, Trace

    from tokenrouter.simulate.shapes import shape_of

    config = checks.config(args.config)
    trace = Trace.load(args.trace) if args.trace else None
    if not args.trace and args.workload not in PRESETS:
        raise ValueError(f"--workload: unknown {args.workload!r}; known: {', '.join(PRESETS)}")
    checks.at_least(args.requests, 1, "--requests")
    if not 0 <= args.share < 1:
        raise ValueError(f"--share: must be in [0, 1), got {args.share}")
    if args.latency not in ("roofline", "profiled"):
        raise ValueError(f"--latency: must be roofline or profiled, got {args.latency!r}")
    for m in config.models:
        shape_of(m.source)
    if args.latency == "roofline" and not args.calibrate and any(m.device == "cpu" for m in config.models):
        raise ValueError("--latency roofline: the config's models are on the CPU, and a roofline needs a GPU preset; "
                         "use --latency profiled with a recorded --trace (bench serve --record-trace)")
    if args.latency == "profiled" and not args.profile and not args.calibrate and not (trace and trace.profiles):
        raise ValueError("--latency profiled: give --profile (h200, h200-eager or a bench runner table) or a --trace "
                         "recorded by bench serve or bench quality (it carries the machine's step profiles)")
    device(args.device)
    if args.network:
        network(args.network)
    if args.placement and args.placement not in ("local", "process", "ray"):
        raise ValueError(f"--placement: must be local, process or ray, got {args.placement!r}")
    if not 0 <= args.kv_efficiency <= 1:
        raise ValueError(f"--kv-efficiency: must be in (0, 1], got {args.kv_efficiency}")
    checks.levels(args.concurrency)
    baselines(args.baselines)


def baselines(text: str) -> list[str]:
    found = [b.strip() for b in text.split(",") if b.strip()]
    unknown = set(found) - set(BASELINES)
    if unknown:
        raise ValueError(f"--baselines: unknown {sorted(unknown)}; known: {', '.join(BASELINES)}")
    return found


def load_trace(args: argparse.Namespace):
    from tokenrouter.simulate.traces import Trace, synthetic

    if args.trace:
        return Trace.load(args.trace)
    return synthetic(args.workload, args.requests, args.share, args.burst, args.seed)


def run(args: argparse.Namespace) -> dict:
    from tokenrouter.config import load_config

    if args.calibrate:
        return calibrate(args)
    trace = load_trace(args)
    if args.record_trace:
        trace.save(args.record_trace)
    overrides = {"placement": args.placement} if args.placement else {}
    if args.tau_ms >= 0:
        overrides["scheduler"] = {"delay_tau_ms": args.tau_ms}
    config = load_config(args.config, **overrides)
    kwargs = dict(latency=args.latency, device=args.device, profile=args.profile, network=args.network,
                  kv_efficiency=args.kv_efficiency)
    started = time.perf_counter()
    rows, header = simulate_levels(config, trace, checks.levels(args.concurrency), baselines(args.baselines), **kwargs)
    real = time.perf_counter() - started
    result = {"simulated": True, "config": args.config, "trace": trace.source, "policy": trace.policy,
              "assumptions": header, "real_seconds": real, "results": rows}
    print_report(header, rows, real)
    write_json(args.json, result)
    return result


def simulate_levels(config, trace, levels: list[int], compared: list[str], echo: bool = True,
                    **kwargs) -> tuple[list[dict], list[str]]:
    """Every concurrency level, each on a fresh simulated engine (virtual time from 0), then its baselines; `echo`
    prints each level's row as JSON as it lands. `kwargs` go to `simulated_service`."""
    from tokenrouter.simulate.service import simulated_service

    rows, header = [], []
    for c in levels:
        svc, sim = simulated_service(config, trace, **kwargs)
        try:
            if not header:
                header = [f"SIMULATED: {trace.source}; {len(trace.requests)} requests, {trace.output_tokens} output "
                          f"tokens, large share {trace.large_share:.1%}; placement {config.placement}"]
                header += sim.assumptions()
            row = measure(svc, sim, c, compared)
        finally:
            svc.close()
        rows.append(row)
        if echo:
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return rows, header


def measure(svc, sim, concurrency: int, compared: list[str]) -> dict:
    """One level: the engine's row (as `bench serve` reports it, on the virtual clock), then the baselines on the
    same simulated workers."""
    row, outs = run_level(svc, sim, concurrency)
    row["simulated"] = True
    models = svc.models
    for name in ("all-large", "all-small", "query"):
        if name in compared:
            other, other_outs = run_level(svc, sim, concurrency, name)
            key = name.replace("-", "_")
            row.update({f"{key}_tokens_per_s": other["tokens_per_s"], f"over_{key}": row["tokens_per_s"] / other["tokens_per_s"],
                        f"{key}_cost_per_task": other["cost_per_task"], f"{key}_ttft_p50_ms": other["ttft_p50_ms"],
                        f"{key}_tpot_p50_ms": other["tpot_p50_ms"],
                        f"{key}_tpot_p99_ms": other["tpot_p99_ms"], f"{key}_e2e_p99_ms": other["e2e_p99_ms"],
                        f"{key}_large_share": other["large_share"],
                        f"{key}_identical": serve.same([o.token_ids for o in outs], [o.token_ids for o in other_outs])})
    for name in ("lockstep", "per-request"):
        if name not in compared or len(models) < 2:
            continue
        if name == "lockstep" and sim.replay.policy.verifies:
            print("note: the lockstep baseline cannot run a verifying policy; skipped", file=sys.stderr)
            continue
        row.update(sequential(svc, sim, concurrency, [o.token_ids for o in outs], name))
        key = name.replace("-", "_")
        row[f"over_{key}"] = row["tokens_per_s"] / row[f"{key}_tokens_per_s"]
    return row


def run_level(svc, sim, concurrency: int, policy: str = "") -> tuple[dict, list]:
    from tokenrouter.simulate.service import run_trace

    before, start, real = svc.stats(), svc.clock(), time.perf_counter()
    outs = run_trace(svc, sim, concurrency, policy)
    wall, real = svc.clock() - start, time.perf_counter() - real
    after = svc.stats()
    models = svc.models
    large = svc.runtime.subservers[models[-1]]
    row = {"concurrency": concurrency, "placement": svc.config.placement, **serve.summarise([o.token_ids for o in outs], wall),
           **serve.latencies(outs), "large_share": serve.share(outs, models[-1]), "tau": large.tau,
           **serve.step_usage(before, after, models, wall), "cost_per_task": cost_per_task(svc, before, after, outs),
           "real_seconds": real}
    if len(models) > 1:
        small = svc.runtime.subservers[models[0]]
        row["both_stepping"] = serve.both_stepping(small.stats.intervals, large.stats.intervals, start, start + wall) / wall
    if not policy and svc.throughput_model is not None:
        written = sum(o.metrics.tokens_per_model.get(models[-1], 0) for o in outs)
        row["large_tokens_per_visit"] = row[f"{models[-1]}_tokens"] / written if written else 0.0
        predicted = svc.predict(concurrency, row["large_share"], tau=row["tau"], catch_up=row["large_tokens_per_visit"] or None)
        row.update(predicted_tokens_per_s=predicted.tokens_per_s, predicted_tpot_ms=predicted.tpot * 1e3,
                   measured_over_predicted=row["tokens_per_s"] / predicted.tokens_per_s)
    return row, outs


def cost_per_task(svc, before: dict, after: dict, outs: list) -> float:
    """Dollars per completed request: every model's busy seconds in the run at its `price_per_hour`."""
    completed = sum(1 for o in outs if not o.error)
    dollars = sum((after[m]["busy_seconds"] - before[m]["busy_seconds"]) * price / 3600
                  for m, price in svc.prices_per_hour.items())
    return dollars / completed if completed else float("nan")


def sequential(svc, sim, concurrency: int, engine_ids: list[list[int]], name: str) -> dict:
    """A baseline that runs its steps one after another on the same simulated workers (the lockstep batch waits for
    its slowest model; the per-request loop runs one request at a time): its time is the sum of its steps' modelled
    seconds."""
    from tokenrouter.bench.lockstep import generate_lockstep
    from tokenrouter.bench.per_request import generate_one
    from tokenrouter.engine.sequence import SamplingParams

    trace = sim.replay.trace
    requests = [(r.prompt(), SamplingParams(max_tokens=r.output_tokens, seed=i, ignore_eos=True))
                for i, r in enumerate(trace.requests)]
    subs = svc.runtime.subservers
    executors, blocks = {m: subs[m].executor for m in svc.models}, {m: subs[m].blocks for m in svc.models}
    before = sum(e.ran_seconds for e in executors.values())
    if name == "lockstep":
        seqs = generate_lockstep(executors, blocks, set(), requests, sim.replay.policy, concurrency)
    else:
        seqs = [generate_one(executors, blocks, set(), ids, params, sim.replay.policy) for ids, params in requests]
    wall = sum(e.ran_seconds for e in executors.values()) - before
    key = name.replace("-", "_")
    tokens_per_s = serve.summarise([s.output_ids for s in seqs], wall)["tokens_per_s"]
    return {f"{key}_tokens_per_s": tokens_per_s, f"{key}_identical": serve.same(engine_ids, [s.output_ids for s in seqs])}


def verdict(row: dict) -> str:
    """Token-level routing (the engine) against the query-level router at the same large share, in one line."""
    if "query_tokens_per_s" not in row:
        return ""
    speed = row["tokens_per_s"] / row["query_tokens_per_s"]
    cost = row["cost_per_task"] / row["query_cost_per_task"] if row["query_cost_per_task"] else float("nan")
    faster = f"{speed:.2f}x the query-level router's tokens/s" if speed >= 1 else \
        f"QUERY-LEVEL ROUTING IS FASTER: token-level writes {speed:.2f}x its tokens/s"
    cheaper = f"{cost:.2f}x its cost per task"
    wins = "token-level wins" if speed >= 1 and cost <= 1 else \
        "query-level wins" if speed < 1 and cost > 1 else "mixed"
    return f"C={row['concurrency']}: {wins}: {faster}, at {cheaper} (query-level large share {row['query_large_share']:.0%})"


def print_report(header: list[str], rows: list[dict], real_seconds: float) -> None:
    for line in header:
        print(line)
    serve.print_table(rows)
    print("\n| C | engine tok/s | all-large | all-small | query-level | engine $/task | query $/task |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[k]:.1f}" if k in r else "-" for k in ("all_large_tokens_per_s", "all_small_tokens_per_s",
                                                            "query_tokens_per_s")]
        query_cost = f"{r['query_cost_per_task']:.2e}" if "query_cost_per_task" in r else "-"
        print(f"| {r['concurrency']} | {r['tokens_per_s']:.1f} | {' | '.join(cells)} | {r['cost_per_task']:.2e} | {query_cost} |")
    for r in rows:
        line = verdict(r)
        if line:
            print(line)
    for r in rows:
        print(f"C={r['concurrency']}: the engine's run, {r['seconds']:.1f} s simulated, took {r['real_seconds']:.1f} s of "
              f"real time (a simulated hour: {3600 * r['real_seconds'] / r['seconds']:.0f} s)")
    print(f"(every figure simulated; {real_seconds:.1f} s of real time in all)")


# ---- calibration -------------------------------------------------------------------------------------------------
def calibrate(args: argparse.Namespace) -> dict:
    """Simulated against measured: the H200 routed runs shipped with the project, and a real run on this machine."""
    from tokenrouter.config import load_config

    rows = h200_calibration()
    config = load_config(args.config)
    if all(m.device == "cpu" for m in config.models):
        rows += cpu_calibration(args)
    print("\n| run | C | measured tok/s | simulated tok/s | error | measured TPOT p50 ms | simulated | error "
          "| same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['concurrency']} | {r['measured_tokens_per_s']:.1f} | {r['simulated_tokens_per_s']:.1f} "
              f"| {r['tokens_per_s_error']:+.0%} | {r['measured_tpot_p50_ms']:.1f} | {r['simulated_tpot_p50_ms']:.1f} "
              f"| {r['tpot_error']:+.0%} | {r.get('same_tokens', '-')} |")
    result = {"simulated": True, "calibration": rows}
    write_json(args.json, result)
    return result


def compared(run: str, concurrency: int, measured: dict, simulated: dict, **extra) -> dict:
    return {"run": run, "concurrency": concurrency,
            "measured_tokens_per_s": measured["tokens_per_s"], "simulated_tokens_per_s": simulated["tokens_per_s"],
            "tokens_per_s_error": simulated["tokens_per_s"] / measured["tokens_per_s"] - 1,
            "measured_tpot_p50_ms": measured["tpot_p50_ms"], "simulated_tpot_p50_ms": simulated["tpot_p50_ms"],
            "tpot_error": simulated["tpot_p50_ms"] / measured["tpot_p50_ms"] - 1, **extra}


def h200_calibration() -> list[dict]:
    """The routed runs of `tests/gpu/run.sh` on one H200 (eager engine, random Qwen3-0.6B / 8B shapes,
    random:share=0.15, 16 requests of serve's prompts, 32 tokens): each run's trace rebuilt from its summary (the
    prompts' lengths, its output tokens and large share; the per-token sends were not recorded, so they are drawn at
    that share) and simulated on the H200's measured eager steps."""
    from tokenrouter.config import load_config
    from tokenrouter.simulate.fit import H200_SERVE_BOTH, H200_SERVE_LOCAL
    from tokenrouter.simulate.service import simulated_service

    lengths = prompt_lengths()
    rows = []
    for path in (H200_SERVE_LOCAL, H200_SERVE_BOTH):
        data = json.loads(path.read_text())
        for measured in data["results"]:
            trace = summary_trace(lengths, data["requests"], data["max_tokens"], measured["output_tokens"],
                                  measured["large_share"])
            config = load_config(data["config"], placement=measured["placement"])
            svc, sim = simulated_service(config, trace, latency="profiled", profile="h200-eager")
            try:
                simulated, _ = run_level(svc, sim, measured["concurrency"])
            finally:
                svc.close()
            rows.append(compared(f"H200 {measured['placement']} ({path.name})", measured["concurrency"], measured,
                                 simulated))
    return rows


def prompt_lengths() -> list[int]:
    """Tokens of each of serve's prompts under the tiny models' byte tokenizer and chat template (the H200 runs')."""
    from transformers import AutoTokenizer

    from tokenrouter.models.tiny import build_tiny_model_dir

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model_dir("qwen3"))
    return [len(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                              tokenize=True)) for p in serve.PROMPTS]


def summary_trace(prompt_lengths: list[int], requests: int, max_tokens: int, output_tokens: int, share: float):
    """A trace with a run's prompts, its total output (requests cut short from the last, as early stops would) and
    sends drawn at its large share."""
    import numpy as np

    from tokenrouter.simulate.traces import Trace, TraceRequest

    outputs = [max_tokens] * requests
    short = requests * max_tokens - output_tokens
    for i in reversed(range(requests)):
        cut = min(short, outputs[i] - 1)
        outputs[i] -= cut
        short -= cut
    rng = np.random.default_rng(0)
    reqs = [TraceRequest(prompt_lengths[i % len(prompt_lengths)], n, [int(j) for j in np.flatnonzero(rng.random(n) < share)])
            for i, n in enumerate(outputs)]
    return Trace(reqs, f"random:share={share:g}", f"rebuilt from a run summary: {requests} requests, {output_tokens} tokens")


def cpu_calibration(args: argparse.Namespace) -> list[dict]:
    """A real run of --config on this machine at each level, its trace recorded at the first, then each level
    simulated from that trace on the step profiles the engine measured."""
    import tokenrouter
    from tokenrouter.config import load_config
    from tokenrouter.simulate.service import simulated_service

    levels = checks.levels(args.concurrency)
    real = {}
    with tokenrouter.serve(args.config) as svc:
        policy = svc.policy(args.policy)
        prompts = [svc.prepare(serve.PROMPTS[i % len(serve.PROMPTS)], policy, max_tokens=args.max_tokens)[0]
                   for i in range(args.requests)]
        for c in levels:
            real[c] = serve.measure_engine(svc, prompts, policy, c, args.max_tokens)
        trace = serve.trace_of(svc, prompts, real[levels[0]][1], policy,
                               f"bench serve --config {args.config} --policy {args.policy}, C={levels[0]}",
                               real[levels[0]][0])
    if args.record_trace:
        trace.save(args.record_trace)
    config = load_config(args.config)
    rows = []
    for c in levels:
        svc, sim = simulated_service(config, trace, latency="profiled")
        try:
            simulated, outs = run_level(svc, sim, c)
        finally:
            svc.close()
        measured, real_outs = real[c]
        rows.append(compared(f"this machine, {config.placement}", c, measured, simulated,
                             same_tokens=serve.same([o.token_ids for o in real_outs], [o.token_ids for o in outs])))
    return rows
