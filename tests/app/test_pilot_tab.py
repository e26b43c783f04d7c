"""Pilot rows and charts: loading saved benchmark JSON (errors name what is missing), sweeping on the
engine, and the three charts."""
from __future__ import annotations

import json
import math

import pytest

from app import charts
from app.pilot import load_results, parse_levels, quality, sweep

SERVE_ROW = {"concurrency": 1, "tokens_per_s": 10.0, "ttft_p50_ms": 5.0, "ttft_p99_ms": 9.0, "tpot_p50_ms": 2.0,
             "tpot_p99_ms": 3.0, "itl_p50_ms": 2.0, "itl_p99_ms": 4.0, "e2e_p50_ms": 100.0, "e2e_p99_ms": 150.0}


def write(tmp_path, data) -> str:
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_serve_results_take_their_run_policy_and_lists_of_runs_load_together(tmp_path):
    runs = [{"policy": "all-small", "results": [SERVE_ROW, {**SERVE_ROW, "concurrency": 4}]},
            {"policy": "random:share=0.15", "results": [{**SERVE_ROW, "policy": "own"}]}]
    rows = load_results(write(tmp_path, runs))
    assert [(r["policy"], r["concurrency"]) for r in rows] == [("all-small", 1), ("all-small", 4), ("own", 1)]


@pytest.mark.parametrize("data, message", [
    ({"policy": "x"}, "no 'results' list"),
    ({"results": [{"concurrency": 1}]}, r"results\[0\]: missing or non-numeric tokens_per_s"),
    ({"results": []}, "no result rows"),
    ([1], "run 0"),
])
def test_malformed_results_name_what_is_wrong(tmp_path, data, message):
    with pytest.raises(ValueError, match=message):
        load_results(write(tmp_path, data))


def test_unreadable_files_are_value_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read bad.json"):
        load_results(str(bad))


def test_levels_parse_and_reject_bad_values():
    assert parse_levels("1, 4,16") == [1, 4, 16]
    for text in ("", "0", "a,b"):
        with pytest.raises(ValueError, match="concurrency"):
            parse_levels(text)


def test_quality_reads_pass_at_1_under_either_key():
    assert quality({"pass@1": 0.25}) == 0.25 and quality({"pass_at_1": 1}) == 1.0 and quality({}) is None


def test_sweep_rows_per_policy_and_level_with_latencies_and_cost(svc):
    seen = []
    result = sweep(svc, ["all-small", "all-large"], [1, 3], ["a", "b", "c"], 4,
                   progress=lambda f, what: seen.append(what))
    rows = result["results"]
    assert [(r["policy"], r["concurrency"]) for r in rows] == [("all-small", 1), ("all-small", 3),
                                                               ("all-large", 1), ("all-large", 3)]
    assert all(r["output_tokens"] == 12 and r["failed"] == 0 and r["e2e_p99_ms"] >= r["e2e_p50_ms"] for r in rows)
    assert [r["large_share"] for r in rows] == [0, 0, 1, 1]
    # the large model is priced 3x the small one and runs slower: all-large costs more per request
    assert rows[2]["cost_per_request"] > rows[0]["cost_per_request"] > 0
    assert len(seen) == 4 and seen[0] == "all-small at concurrency 1"
    with pytest.raises(ValueError, match="policies"):
        sweep(svc, [], [1], ["a"], 4)


def test_charts_have_a_trace_per_policy_and_say_when_quality_is_missing():
    rows = [{**SERVE_ROW, "policy": p, "concurrency": c, "tokens_per_s": 10.0 * c} for p in ("a", "b")
            for c in (4, 1)]
    fig = charts.throughput(rows)
    assert [t.name for t in fig.data] == ["a", "b"] and list(fig.data[0].x) == [1, 4]
    assert len(charts.latency_percentiles(rows).data) == 2 * 4 * 2
    empty = charts.quality_cost(rows)
    assert not empty.data and "no pass@1" in empty.layout.annotations[0].text
    scored = [{**r, "pass@1": 0.5, "cost_per_completed": 0.02} for r in rows] + [
        {**rows[0], "pass@1": 0.4, "cost_per_completed": math.inf}]
    fig = charts.quality_cost(scored)
    assert [t.name for t in fig.data] == ["a", "b"] and list(fig.data[0].y) == [0.5, 0.5]  # inf is left out
    assert fig.layout.xaxis.title.text == "dollars per completed task"
