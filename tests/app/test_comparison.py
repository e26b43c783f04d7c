"""The side-by-side line under the two answers, costs in one format, the pilot table rounded, and one colour
per policy across the pilot's charts."""
from __future__ import annotations

import math

from app import charts
from app.live import LiveRequest
from app.pilot_tab import table
from app.policies import resolve
from app.pricing import dollars_text
from app.render import comparison_html
from tokenrouter.engine.sequence import TokenRecord

MODELS = ["small", "large"]


def finished(spec: str, cost: float | None, seconds: float, tokens: int = 8, handoffs: str = "") -> LiveRequest:
    spec, policy = resolve(spec)
    request = LiveRequest(MODELS, policy, spec=spec)
    request.records = [TokenRecord(1, "a", "large" if i < len(handoffs) and handoffs[i] == "L" else "small", 0.0,
                                   0.1 * i) for i in range(tokens)]
    request.finish(None, cost)
    request.started, request.ended = 0.0, seconds
    return request


def test_one_cost_format_three_significant_digits_in_plain_decimals():
    assert dollars_text(0.0093) == "$0.00930" and dollars_text(9.68e-4) == "$0.000968"
    assert dollars_text(6.11e-7) == "$0.000000611" and dollars_text(0.0) == "$0"
    assert dollars_text(1.234) == "$1.23" and dollars_text(3e-4, estimated=True) == "~$0.000300"
    assert dollars_text(None) == "&ndash;" and dollars_text(math.nan) == "&ndash;"


def test_the_line_says_when_query_level_routing_won_and_why():
    query = finished("query-random:share=0.5", 0.0053, 2.0)
    token = finished("confidence:threshold=0.9", 0.0061, 2.5, handoffs="sLsL")
    line = comparison_html([query, token])
    assert "query-level <code>query-random:share=0.5</code> was cheaper: $0.00530 against $0.00610 (13% less)" in line
    assert "query-level <code>query-random:share=0.5</code> was faster: 2.00 s against 2.50 s (20% less)" in line
    assert "Query-level routing won on cost here" in line and "2 hand-offs" in line and "faster too" in line


def test_the_line_names_the_cheaper_and_the_faster_when_they_differ():
    query = finished("query-random:share=0.5", 0.0080, 1.0, tokens=6)
    token = finished("confidence:threshold=0.9", 0.0040, 3.0)
    line = comparison_html([query, token])
    assert "token-level <code>confidence:threshold=0.9</code> was cheaper: $0.00400 against $0.00800 (50% less)" in line
    assert "query-level <code>query-random:share=0.5</code> was faster" in line
    assert "answers of 6 and 8 tokens" in line and "won on cost" not in line


def test_no_line_while_running_and_no_cost_claim_without_prices():
    running = finished("all-small", None, 1.0)
    running.ended = None
    assert comparison_html([running, finished("all-large", None, 1.0)]) == ""
    line = comparison_html([finished("all-small", None, 1.0), finished("all-large", None, 2.0)])
    assert "cheaper" not in line and "was faster: 1.00 s against 2.00 s" in line


def test_a_stopped_request_is_priced_from_its_records(svc):
    spec, policy = resolve("schedule:every=2")
    request = LiveRequest(svc.models, policy, prompt_tokens=5, spec=spec)
    request.records = [TokenRecord(1, "a", m, 0.0, 0.1) for m in ("small", "large") * 4]
    svc.generate("hi", policy="schedule:every=2", max_tokens=4)  # both models have busy time to price
    request.stop()
    request.price_stopped(svc)
    assert request.cost > 0 and request.cost_estimated and request.summary()["finish"] == "stopped"


ROWS = [{"policy": p, "concurrency": c, "tokens_per_s": 12.345678, "ttft_p50_ms": 152.4321, "e2e_p99_ms": 4490.5,
         "large_share": 0.153846, "failed": 0, "cost_per_completed": 0.000123456, "pass@1": 0.7083333}
        for p in ("all-small", "confidence:threshold=0.9", "all-large") for c in (1, 4)]


def test_the_pilot_table_is_rounded():
    row = table(ROWS).iloc[0].to_dict()
    assert row["tokens_per_s"] == 12.3 and row["ttft_p50_ms"] == 152 and row["e2e_p99_ms"] == 4490
    assert row["large_share"] == 0.154 and row["cost_per_completed"] == 0.000123 and row["pass@1"] == 0.708


def test_a_policy_has_one_colour_in_every_chart():
    # the first policy has no pass@1: the quality chart leaves it out, and the others keep their colours
    rows = [r if r["policy"] != "all-small" else {k: v for k, v in r.items() if k != "pass@1"} for r in ROWS]
    colours = charts.policy_colours(rows)
    assert len(set(colours.values())) == 3
    seen: dict[str, set] = {}
    for fig in (charts.quality_cost(rows, colours), charts.throughput(rows, colours),
                charts.latency_percentiles(rows, colours)):
        for trace in fig.data:
            colour = trace.marker.color if trace.mode == "markers" else trace.line.color
            seen.setdefault(trace.legendgroup or trace.name, set()).add(colour)
    assert all(len(c) == 1 for c in seen.values()) and {p: next(iter(c)) for p, c in seen.items()} == colours
