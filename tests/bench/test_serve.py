"""`bench serve` and `bench sweep` end to end on the tiny pair: a bar per level (engine and baselines) on
stderr, the machine line above the table, the machine in the JSON."""
from __future__ import annotations

import json

import pytest

from tokenrouter.bench.__main__ import main

PAIR = "config/tiny/pair.yaml"


def machine_above_table(out: str, header: str) -> bool:
    lines = [line for line in out.splitlines() if line.strip()]
    return any(a.startswith("machine: ") and b.startswith(header) for a, b in zip(lines, lines[1:]))


@pytest.mark.parametrize("command, extra, header, bars", [
    ("serve", ["--baselines", "lockstep,per-request", "--concurrency", "1,2"], "| placement | C |",
     ["engine C=1", "engine C=2", "lockstep C=2", "per-request loop"]),
    ("sweep", ["--concurrency", "2", "--tau-ms", "0,auto"], "|   concurrency |", ["C=2 tau 0 ms", "C=2 tau auto"]),
])
def test_levels_show_bars_and_the_run_records_its_machine(command, extra, header, bars, tmp_path, capsys):
    out = tmp_path / "out.json"
    main([command, "--config", PAIR, "--policy", "schedule:2", "--requests", "3", "--max-tokens", "4",
          "--json", str(out), *extra])
    printed = capsys.readouterr()
    for desc in bars:
        assert f"{desc}: 100%" in printed.err and "3/3" in printed.err, desc
    assert machine_above_table(printed.out, header), printed.out
    result = json.loads(out.read_text())
    assert result["machine"]["cores"] >= 1 and result["results"]


def test_a_verifying_policy_is_measured_against_all_large_and_skips_lockstep(tmp_path, capsys):
    out = tmp_path / "out.json"
    main(["serve", "--config", PAIR, "--policy", "verify:every=2", "--requests", "3", "--max-tokens", "6",
          "--concurrency", "2", "--baselines", "lockstep,per-request,all-large", "--json", str(out)])
    printed = capsys.readouterr()
    assert "lockstep baseline cannot run verify:every=2" in printed.err and "lockstep C=2" not in printed.err
    (row,) = json.loads(out.read_text())["results"]
    assert row["all_large_identical"] == "3/3" and row["per_request_identical"] == "3/3"
    assert row["drafted"] >= row["accepted"] >= 0 and row["drafted"] > 0
    assert row["tokens_per_visit"] >= 1 and row["predicted_tokens_per_s"] > 0
    assert row["all_large_ttft_p50_ms"] > 0 and row["all_large_tpot_p50_ms"] > 0
    assert (f"local C=2, p50 TTFT / TPOT ms: engine {row['ttft_p50_ms']:.0f} / {row['tpot_p50_ms']:.1f}, all-large "
            f"{row['all_large_ttft_p50_ms']:.0f} / {row['all_large_tpot_p50_ms']:.1f}") in printed.out


def test_the_step_trace_holds_every_engine_step_of_each_level(tmp_path):
    out, steps = tmp_path / "out.json", tmp_path / "steps.json"
    main(["serve", "--config", PAIR, "--policy", "verify:every=2", "--requests", "3", "--max-tokens", "6",
          "--concurrency", "1,2", "--baselines", "all-large", "--json", str(out), "--step-trace", str(steps)])
    rows = json.loads(out.read_text())["results"]
    trace = json.loads(steps.read_text())
    assert trace["columns"] == ["start_s", "seconds", "rows", "tokens"] and trace["machine"]["cores"] >= 1
    assert [level["concurrency"] for level in trace["levels"]] == [1, 2]
    for level, row in zip(trace["levels"], rows):
        assert level["complete"] and set(level["steps"]) == {"small", "large"}
        for model, taken in level["steps"].items():
            # the engine's run alone: the all-large baseline after it adds none of its steps
            assert len(taken) == row[f"{model}_steps"] > 0
            assert sum(t for *_, t in taken) == row[f"{model}_tokens"]
            assert all(sec > 0 and 1 <= rows <= tokens for _, sec, rows, tokens in taken)
            starts = [start for start, *_ in taken]
            assert starts == sorted(starts) and starts[0] >= 0
        assert min(taken[0][0] for taken in level["steps"].values()) == 0


def test_a_verifying_policy_sweeps_beside_its_prediction_from_the_measured_acceptance():
    import tokenrouter
    from tokenrouter.bench.sweep import COLUMNS, sweep_tau

    with tokenrouter.serve(PAIR) as svc:
        frame = sweep_tau(svc, ["def f(x):", "hello", "SELECT"], svc.policy("verify:every=2"), [1, 2], [0, None],
                          max_tokens=6)
        assert list(frame["tau_setting"]) == ["0 ms", "auto"] * 2
        for row in frame.to_dict("records"):
            assert row["drafted"] > 0 and 0 <= row["acceptance_rate"] <= 1
            assert row["tokens_per_visit"] == pytest.approx(1 + row["acceptance_rate"] * row["drafts_per_visit"])
            predicted = svc.predict_verify(row["concurrency"], row["acceptance_rate"], row["drafts_per_visit"],
                                           tau=row["tau"])
            assert row["predicted_tokens_per_s"] == pytest.approx(predicted.tokens_per_s)
            assert row["measured_over_predicted"] == pytest.approx(row["tokens_per_s"] / predicted.tokens_per_s)
    assert {"acceptance_rate", "drafts_per_visit", "tokens_per_visit"} <= {c for c in COLUMNS if c in frame}  # printed
