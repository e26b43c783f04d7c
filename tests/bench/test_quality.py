"""The quality harness through the engine on the tiny pair: canned responses for verdicts, the CLI end to end."""
from __future__ import annotations

import dataclasses
import json

import pytest

from tokenrouter.bench.__main__ import main
from tokenrouter.bench.humaneval import PROJECT_TASKS, Task, load_tasks, request
from tokenrouter.bench import bwrap
from tokenrouter.bench.quality import evaluate, split_policies
from tokenrouter.bench.sandbox import SANDBOXED, UNSANDBOXED, SandboxUnavailable


def test_policy_lists_keep_parameters_together():
    assert split_policies("all-small,random:share=0.15,seed=3,all-large") == \
        ["all-small", "random:share=0.15,seed=3", "all-large"]
    assert split_policies("all-large,verify:of=(rolling:window=2,of=(momentum:entropy)),hold=8,confidence:0.8") == \
        ["all-large", "verify:of=(rolling:window=2,of=(momentum:entropy)),hold=8", "confidence:0.8"]
    with pytest.raises(ValueError, match="policies"):
        split_policies(" , ")


def test_canned_responses_are_judged_and_priced(svc):
    tasks = load_tasks(PROJECT_TASKS)[:4]
    outs = svc.generate_batch([request(t) for t in tasks], concurrency=4, policy="schedule:every=2", max_tokens=6)
    texts = [f"```python\n{tasks[0].prompt}{tasks[0].canonical_solution}```",  # a full definition
             tasks[1].canonical_solution,  # a completion of the prompt
             "```python\ndef nothing():\n    pass\n```",  # code without the entry point
             "while True:"]  # not code at all
    canned = [dataclasses.replace(o, text=t) for o, t in zip(outs, texts)]
    row = evaluate(svc, tasks, "schedule:every=2", concurrency=4, responses=canned)
    assert [t["status"] for t in row["tasks"]] == ["passed", "passed", "failed", "syntax_error"]
    assert row["passed"] == 2 and row["pass@1"] == 0.5 and row["failed"] == 0
    assert row["policy"] == "schedule:every=2" and row["level"] == "token" and row["sandbox"] == SANDBOXED
    assert row["output_tokens"] == sum(len(o.tokens) for o in outs)
    large = sum(o.metrics.tokens_per_model["large"] for o in outs)
    assert row["large_share"] == pytest.approx(large / row["output_tokens"])
    for key in ("ttft", "tpot", "itl"):
        assert row[f"{key}_p50_ms"] <= row[f"{key}_p99_ms"]


def test_a_refused_request_is_a_failure_that_costs_and_completes_nothing(svc):
    tasks = load_tasks(PROJECT_TASKS)[:2]
    outs = svc.generate_batch([request(t) for t in tasks], concurrency=2, policy="all-small", max_tokens=4)
    refused = dataclasses.replace(outs[1], text="", finish_reason="error", error="engine overloaded")
    solved = dataclasses.replace(outs[0], text=tasks[0].canonical_solution)
    row = evaluate(svc, tasks, "all-small", responses=[solved, refused])
    assert row["failed"] == 1 and row["passed"] == 1
    assert row["tasks"][1]["status"] == "request_failed"


def test_an_answer_or_a_task_the_harness_cannot_handle_fails_that_task_only(svc):
    """Issue 26, item 6: an unfenced answer whose `return` is followed by 3,000 `-1` tokens made `ast.parse`
    raise RecursionError while its code was extracted, and a task whose test holds a lone surrogate (one
    that did not come through `load_tasks`, which refuses it) raised UnicodeEncodeError while its files were
    written; either ended the whole run. Now each is that task's `harness_error` and the others are judged."""
    tasks = load_tasks(PROJECT_TASKS)[:3]
    surrogate = Task("t/surrogate", tasks[0].prompt, tasks[0].entry_point, tasks[0].test + '    assert "\ud800"\n')
    tasks.append(surrogate)
    outs = svc.generate_batch([request(t) for t in tasks], concurrency=4, policy="all-small", max_tokens=2)
    deep = f"Here it is:\n\ndef {tasks[1].entry_point}(a, b):\n    return {' '.join(['-1'] * 3000)}\n"
    texts = [tasks[0].canonical_solution, deep, tasks[2].canonical_solution, tasks[0].canonical_solution]
    canned = [dataclasses.replace(o, text=t) for o, t in zip(outs, texts)]
    row = evaluate(svc, tasks, "all-small", responses=canned)
    assert [t["status"] for t in row["tasks"]] == ["passed", "harness_error", "passed", "harness_error"]
    assert row["passed"] == 2
    assert "RecursionError" in row["tasks"][1]["detail"] and "longest_parsable" in row["tasks"][1]["detail"]
    assert "UnicodeEncodeError" in row["tasks"][3]["detail"]


def test_without_a_sandbox_nothing_is_generated_or_run_unless_allowed(svc, monkeypatch):
    tasks = load_tasks(PROJECT_TASKS)[:1]
    monkeypatch.setattr(bwrap, "unavailable", lambda: "bubblewrap (bwrap) is not installed")
    before = svc.stats()["small"]["steps"]
    with pytest.raises(SandboxUnavailable, match="--unsafe-no-sandbox"):
        evaluate(svc, tasks, "all-small", max_tokens=4)
    assert svc.stats()["small"]["steps"] == before
    with pytest.raises(SandboxUnavailable):
        main(["quality", "--config", "config/tiny/pair.yaml", "--policies", "all-small"])
    row = evaluate(svc, tasks, "all-small", max_tokens=4, unsafe_no_sandbox=True)
    assert row["sandbox"] == UNSANDBOXED and row["tasks"][0]["status"] != "passed"


def test_cli_runs_every_policy_on_the_tiny_pair(tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(PROJECT_TASKS.read_text().splitlines()[:3]) + "\n")
    out = tmp_path / "out.json"
    main(["quality", "--config", "config/tiny/pair.yaml", "--tasks", str(tasks), "--policies",
          "all-small,random:0.5,seed=1", "--concurrency", "2", "--max-tokens", "8", "--json", str(out),
          "--record-trace", str(tmp_path / "trace-{policy}.json")])
    result = json.loads(out.read_text())
    printed = capsys.readouterr()
    machine = [line for line in printed.out.splitlines() if line.startswith("machine: ")]
    assert machine and printed.out.splitlines().index(machine[0]) + 1 == printed.out.splitlines().index(
        next(line for line in printed.out.splitlines() if line.startswith("| policy |")))  # just above the table
    assert result["machine"]["cpu"] in machine[0] and result["machine"]["cores"] >= 1
    assert "random:share=0.5 answering" in printed.err and "random:share=0.5 checking" in printed.err
    assert "3/3" in printed.err
    assert result["sandbox"] == SANDBOXED
    assert result["num_tasks"] == 3 and [r["policy"] for r in result["results"]] == ["all-small", "random:share=0.5"]
    small, routed = result["results"]
    assert small["large_share"] == 0 and small["busy_seconds"]["large"] == 0 and small["busy_seconds"]["small"] > 0
    assert routed["large_share"] > 0 and routed["busy_seconds"]["large"] > 0
    for row in result["results"]:
        assert len(row["tasks"]) == 3 and row["output_tokens"] > 0 and row["tokens_per_s"] > 0
        assert row["dollars"] > 0 and (row["cost_per_completed"] is None) == (row["passed"] == 0)  # JSON null: none passed
        assert row["activated_params"] > 0
        assert row["memory_bound"] and all(t["memory"] in row["memory_bound"] for t in row["tasks"])
    from tokenrouter.simulate.traces import Trace  # each policy's routing trace, for bench simulate

    traces = {p.name: Trace.load(p) for p in tmp_path.glob("trace-*.json")}
    assert sorted(traces) == ["trace-all-small.json", "trace-random_0.5_seed=1.json"]
    trace = traces["trace-random_0.5_seed=1.json"]
    assert len(trace.requests) == 3 and trace.large_share == pytest.approx(routed["large_share"])
    assert sum(r.output_tokens for r in trace.requests) == routed["output_tokens"]
    with pytest.raises(SystemExit):  # several policies into one trace file
        main(["quality", "--config", "config/tiny/pair.yaml", "--policies", "all-small,all-large",
              "--record-trace", str(tmp_path / "t.json")])
