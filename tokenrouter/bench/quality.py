"""Answer quality with executable checks: every task through the engine (`Service.generate_batch`), the code
of each response run against the task's tests in the sandbox; per policy pass@1, completed tasks, failed
requests, cost per completed task, large-model share, output tokens/s and TTFT / TPOT / ITL percentiles.

    python -m tokenrouter.bench quality --config config/embedded/qwen2.5-coder-0.5b_1.5b.yaml \\
        --tasks tokenrouter/bench/tasks/tokenrouter_tasks.jsonl --policies all-small,all-large \\
        --concurrency 8 --max-tokens 512 --json out.json
"""
from __future__ import annotations

import argparse
import json
import re
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tokenrouter
from tokenrouter.bench import checks, progress, write_json
from tokenrouter.bench.cost import (activated_parameters, attributed_cost, between, parameters, prices, run_cost,
                                    usage)
from tokenrouter.bench.humaneval import MODES, PROJECT_TASKS, Task, extract_code, load_tasks, program, request
from tokenrouter.bench.machine import announce, machine
from tokenrouter.bench.sandbox import (HARNESS_ERROR, MIN_PROCESS_MB, SandboxResult, SandboxUnavailable,
                                       add_sandbox_argument, check_limits, isolation, run_tests)
from tokenrouter.bench.serve import latencies, share
from tokenrouter.bench.serve import record_trace as record_trace_of
from tokenrouter.service.output import RoutedOutput
from tokenrouter.policies import top_level

SANDBOX_WORKERS = 2
PROJECT = Path(tokenrouter.__file__).parent


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True)
    p.add_argument("--tasks", default=str(PROJECT_TASKS), help="a HumanEval-format JSONL file")
    p.add_argument("--split", default="", help="only the tasks whose 'split' field is this (e.g. heldout)")
    p.add_argument("--policies", default="all-small,all-large", help="comma-separated policy specs")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--mode", choices=MODES, default="chat",
                   help="chat: an instruction, code taken from the reply; completion: the raw prompt, continued")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per sandboxed test run")
    p.add_argument("--memory-mb", type=int, default=1024,
                   help="memory of a whole sandboxed test run, all its processes together (a cgroup's memory.max "
                        "where one is delegated, else divided over a process limit; each task says which)")
    add_sandbox_argument(p)
    p.add_argument("--record-trace", default="",
                   help="write each policy's routing trace here, for `bench simulate --trace` (with several --policies, "
                        "put {policy} in the path)")
    p.add_argument("--json", default="")


def split_policies(text: str) -> list[str]:
    """`a,b:k=1,j=2,c` -> ['a', 'b:k=1,j=2', 'c']: an item `key=value` without a name continues the
    previous policy's parameters; commas inside parentheses (`verify:of=(rolling:of=entropy,window=4)`) split nothing."""
    specs: list[str] = []
    for item in (s.strip() for s in top_level(text)):
        if not item:
            continue
        if "=" in item and ":" not in item and specs:
            specs[-1] += f",{item}"
        else:
            specs.append(item)
    if not specs:
        raise ValueError("policies: give at least one policy")
    return specs


def check_args(args: argparse.Namespace) -> None:
    """Every argument, before any model loads (raises ValueError naming the argument)."""
    checks.config(args.config)
    checks.tasks(args.tasks, args.split)
    checks.policies(split_policies(args.policies), "--policies")
    check_task_options(args)
    if args.record_trace and len(split_policies(args.policies)) > 1 and "{policy}" not in args.record_trace:
        raise ValueError("--record-trace: with several --policies, put {policy} in the path (one trace per policy)")


def check_task_options(args: argparse.Namespace) -> None:
    """The options `quality` and `pilot` share."""
    checks.at_least(args.concurrency, 1, "--concurrency")
    checks.at_least(args.max_tokens, 1, "--max-tokens")
    checks.above(args.timeout, 0, "--timeout")
    checks.at_least(args.memory_mb, 2 * MIN_PROCESS_MB, "--memory-mb")


def run(args: argparse.Namespace) -> dict:
    tasks = load_tasks(args.tasks, args.split)
    sandbox = isolation(args.unsafe_no_sandbox)  # refuse before any model loads
    rows, host = [], machine()
    with tokenrouter.serve(args.config) as svc:
        for spec in split_policies(args.policies):
            row = evaluate(svc, tasks, spec, concurrency=args.concurrency, max_tokens=args.max_tokens,
                           mode=args.mode, timeout=args.timeout, memory_mb=args.memory_mb,
                           unsafe_no_sandbox=args.unsafe_no_sandbox,
                           record_trace=args.record_trace.replace("{policy}", re.sub(r"[^\w.=-]+", "_", spec)))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tasks"}), flush=True)
    result = {"config": args.config, "tasks_file": args.tasks, "split": args.split, "num_tasks": len(tasks),
              "mode": args.mode, "max_tokens": args.max_tokens, "sandbox": sandbox, "machine": host, "results": rows}
    announce(host)
    print(markdown(rows))
    write_json(args.json, result)
    return result


def evaluate(svc, tasks: list[Task], policy: str, concurrency: int = 8, max_tokens: int = 512,
             mode: str = "chat", timeout: float = 10.0, memory_mb: int = 1024,
             responses: list[RoutedOutput] | None = None, unsafe_no_sandbox: bool = False,
             record_trace: str = "") -> dict:
    """One policy on every task: a result row (the serving schema of `bench serve`, plus quality and cost)
    with a per-task list under "tasks". `responses` skips generation (canned outputs, for tests). Raises
    SandboxUnavailable before generating where the answers could not be checked in the sandbox, and ValueError
    for limits it cannot run under. `record_trace`: write the run's routing trace there (serve.record_trace)."""
    sandbox = isolation(unsafe_no_sandbox)
    check_limits(timeout, memory_mb)
    routed = svc.policy(policy)
    before, start = usage(svc), time.perf_counter()
    if responses is None:
        responses = progress.generate_batch(svc, [request(t, mode) for t in tasks], concurrency,
                                            f"{routed.describe()} answering", policy=routed, max_tokens=max_tokens)
    wall, after = time.perf_counter() - start, usage(svc)
    if record_trace:
        prompts = [svc.encode(r["prompt"], r.get("raw", False)) for r in (request(t, mode) for t in tasks)]
        record_trace_of(record_trace, svc, prompts, responses, routed, f"bench quality --policies {policy} "
                        f"--mode {mode} --max-tokens {max_tokens}, {len(tasks)} tasks, C={concurrency}", {})
    results = check_all(tasks, responses, timeout, memory_mb, f"{routed.describe()} checking", unsafe_no_sandbox)
    passed = sum(c.passed for c in results)
    cost = run_cost(before, after, prices(svc), completed=passed)
    used, per_second = between(before, after), prices(svc)
    tokens = sum(len(o.tokens) for o in responses)
    return {
        "policy": routed.describe(), "level": getattr(routed, "level", "token"), "concurrency": concurrency,
        "tasks_total": len(tasks), "passed": passed, "pass@1": passed / len(tasks),
        "output_tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        **latencies(responses), "large_share": share(responses, svc.models[-1]),
        "activated_params": activated_parameters(responses, parameters(svc),
                                                 home_decides=not getattr(routed, "moves_home", False)),
        "busy_seconds": cost.busy_seconds, "dollars": cost.dollars, "cost_per_completed": cost.per_completed_task,
        "cost_per_request": cost.dollars / len(tasks), "sandbox": sandbox,
        "memory_bound": sorted({c.memory for c in results if c.memory}),
        "tasks": [{"task_id": t.task_id, "status": c.status, "detail": c.detail[-500:], "memory": c.memory,
                   "finish_reason": o.finish_reason, "output_tokens": len(o.tokens),
                   "large_share": o.metrics.large_share, "dollars": attributed_cost(o, used, per_second)}
                  for t, o, c in zip(tasks, responses, results)],
    }


def check(task: Task, response: str, timeout: float = 10.0, memory_mb: int = 1024,
          unsafe_no_sandbox: bool = False) -> SandboxResult:
    """The code in `response` run against `task`'s tests in the sandbox (the tests in a process of their own).
    NOTE: the one boundary of a task: whatever raises while its answer is handled (extracting the code,
    assembling the program, writing its files, running and judging it) fails this task alone as
    `harness_error`, naming the exception and where it was raised, and the run goes on. Only a missing
    sandbox, which would fail every task alike, still ends the run."""
    try:
        return run_tests(program(task, extract_code(response, task.entry_point)), task.test, task.entry_point,
                         task.prompt, timeout, memory_mb, unsafe_no_sandbox)
    except SandboxUnavailable:
        raise
    except Exception as e:
        return harness_error(e)


def harness_error(e: Exception) -> SandboxResult:
    """A task's result for an exception of the harness's: what it was, and the project's innermost frame."""
    frames = traceback.extract_tb(e.__traceback__)
    frame = next((f for f in reversed(frames) if PROJECT in Path(f.filename).parents), frames[-1])
    return SandboxResult(HARNESS_ERROR, f"{type(e).__name__}: {e} (in {Path(frame.filename).stem}.{frame.name}, "
                                        f"line {frame.lineno})", 0.0)


def check_all(tasks: list[Task], responses: list[RoutedOutput], timeout: float, memory_mb: int,
              desc: str = "checking", unsafe_no_sandbox: bool = False) -> list[SandboxResult]:
    """Run every response's code against its task's tests (a bar counts the checked and passed tasks); a
    refused request fails without running."""
    def one(pair: tuple[Task, RoutedOutput]) -> SandboxResult:
        task, out = pair
        if out.error:
            return SandboxResult("request_failed", out.error, 0.0)
        return check(task, out.text, timeout, memory_mb, unsafe_no_sandbox)

    results = []
    with progress.bar(len(tasks), desc, unit="task") as checked, ThreadPoolExecutor(SANDBOX_WORKERS) as pool:
        for result in pool.map(one, zip(tasks, responses)):
            results.append(result)
            checked.set_postfix(passed=sum(r.passed for r in results), refresh=False)
            checked.update()
    return results


def markdown(rows: list[dict]) -> str:
    lines = ["| policy | pass@1 | failed | $ / completed task | large share | tok/s | TTFT p50/p99 ms "
             "| TPOT p50/p99 ms | ITL p50/p99 ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['pass@1']:.1%} ({r['passed']}/{r['tasks_total']}) | {r['failed']} | "
                     f"{r['cost_per_completed']:.3g} | {r['large_share']:.0%} | {r['tokens_per_s']:.1f} | "
                     f"{r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.0f}/{r['tpot_p99_ms']:.0f} | "
                     f"{r['itl_p50_ms']:.0f}/{r['itl_p99_ms']:.0f} |")
    return "\n".join(lines)
