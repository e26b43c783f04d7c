"""The pilot report on the tiny pair: baselines, a token-level policy and its share-matched query router."""
from __future__ import annotations

import json

import pytest

from tokenrouter.bench.__main__ import main
from tokenrouter.bench.humaneval import PROJECT_TASKS, load_tasks
from tokenrouter.bench.pilot import markdown, pilot
from tokenrouter.policies import POLICIES

needs_query_router = pytest.mark.skipif("query-random" not in POLICIES, reason="no query-level router registered")


@needs_query_router
def test_pilot_matches_the_query_router_to_the_token_share(svc):
    tasks = load_tasks(PROJECT_TASKS)[:3]
    seen = []
    frame, rows = pilot(svc, tasks, ["schedule:every=3"], ["query-random:share={share}"], concurrency=3,
                        max_tokens=6, progress=lambda row: seen.append(row["policy"]))
    assert list(frame["policy"][:3]) == ["all-small", "all-large", "schedule:every=3"]
    assert seen == list(frame["policy"]) and len(rows) == 4
    token, query = frame.iloc[2], frame.iloc[3]
    assert query["policy"].startswith("query-random:share=") and query["matched_to"] == "schedule:every=3"
    assert float(query["policy"].split("=")[1]) == pytest.approx(token["large_share"], abs=1e-4)
    assert list(frame["level"]) == ["token", "token", "token", "query"]
    assert frame.iloc[0]["large_share"] == 0 and frame.iloc[1]["large_share"] == 1
    assert frame.loc[frame["policy"] == "all-large", "wall_vs_all_large"].iloc[0] == 1
    assert all(len(r["tasks"]) == 3 for r in rows)
    table = markdown(frame).splitlines()
    assert len(table) == 2 + 4 and "| all-large | token | - |" in table[3]


@needs_query_router
def test_levels_are_checked_naming_the_argument(svc):
    tasks = load_tasks(PROJECT_TASKS)[:1]
    with pytest.raises(ValueError, match="token-policies: 'query-random:share=0.2' is a query-level"):
        pilot(svc, tasks, ["query-random:share=0.2"], [])
    with pytest.raises(ValueError, match="query-policies: 'schedule:every=2' is a token-level"):
        pilot(svc, tasks, [], ["schedule:every=2"])


@needs_query_router
def test_pilot_cli_writes_json_and_markdown(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(PROJECT_TASKS.read_text().splitlines()[:2]) + "\n")
    out, table = tmp_path / "pilot.json", tmp_path / "pilot.md"
    main(["pilot", "--config", "config/tiny/pair.yaml", "--tasks", str(tasks), "--split", "",
          "--token-policies", "random:share=0.3,seed=2", "--query-policies", "query-random:share={share},seed=1",
          "--concurrency", "2", "--max-tokens", "5", "--json", str(out), "--markdown", str(table)])
    result = json.loads(out.read_text())
    assert [r["matched_to"] for r in result["results"]] == ["", "", "", "random:share=0.3"]
    assert all(r["concurrency"] == 2 and r["tokens_per_s"] > 0 for r in result["results"])
    assert table.read_text().startswith("machine: ") and table.read_text().count("\n") == 8
    assert result["machine"]["torch"]


@needs_query_router
@pytest.mark.parametrize("spec", ["query-confidence", "query-confidence:tokens=2"])
def test_query_routers_matched_on_the_prompts_send_that_share(svc, spec):
    tasks = load_tasks(PROJECT_TASKS)[:8]
    frame, rows = pilot(svc, tasks, ["schedule:every=4"], [spec], concurrency=4, max_tokens=6,
                        match_on_prompts=True)
    token, query = rows[2], rows[3]
    assert query["matched_to"] == "schedule:every=4" and query["policy"].startswith("query-confidence:")
    # schedule:every=4 writes 1 of its 6 tokens at the large model: that share of the 8 prompts go to it
    moved = sum(t["large_share"] == 1.0 for t in query["tasks"])
    assert moved == round(token["large_share"] * 8) >= 1
    assert all(t["large_share"] in (0.0, 1.0) for t in query["tasks"])
