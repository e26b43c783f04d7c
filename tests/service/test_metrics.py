"""/metrics through prometheus_client (`tokenrouter/service/metrics.py`): the metric names of the service,
typed and described, a real step-latency histogram, one registry per server, the exposition content type."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenrouter.service.metrics import CONTENT_TYPE_LATEST, PER_MODEL, STEP_BUCKETS, ServerMetrics, stats_from_text
from tokenrouter.service.output import RequestMetrics, RoutedOutput

MODELS = ["small", "large"]


def engine_stats(free: int = 7) -> dict:
    per_model = {"free_blocks": free, "total_blocks": 8, "waiting": 1, "running": 2, "parked": 0, "steps": 3,
                 "busy_seconds": 0.5, "forward_seconds": 0.25, "driver_seconds": 0.125, "tokens": 40, "preemptions": 0,
                 "tau": 0.02}
    return {m: dict(per_model) for m in MODELS} | {"active_requests": 2}


def subservers(seconds: dict[str, list[float]]) -> dict:
    return {m: SimpleNamespace(stats=SimpleNamespace(steps=len(s), step_seconds=deque(s))) for m, s in seconds.items()}


def finished(tokens: dict[str, int], handoffs: int) -> RoutedOutput:
    records_metrics = RequestMetrics(0.1, 0.01, 0.2, [], tokens, 0.5, handoffs, {})
    return RoutedOutput("x", [], "length", 3, "schedule:every=2", MODELS, records_metrics)


def families(text: bytes) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def test_counters_gauges_and_a_histogram_with_help_and_type():
    metrics = ServerMetrics(MODELS)
    metrics.finished("/v1/completions", finished({"small": 3, "large": 2}, 2))
    metrics.failed("/v1/completions", 503)
    text = metrics.render(engine_stats(), subservers({"small": [0.004, 0.03], "large": [0.3]}))
    found = families(text)
    assert found["tokenrouter_requests"].type == "counter" and found["tokenrouter_kv_blocks_free"].type == "gauge"
    assert b"# HELP tokenrouter_requests_total HTTP generation requests" in text
    assert b"# TYPE tokenrouter_step_seconds histogram" in text
    assert {(s.labels["endpoint"], s.labels["outcome"], s.value) for s in found["tokenrouter_requests"].samples
            if s.name.endswith("_total")} == {("/v1/completions", "length", 1.0), ("/v1/completions", "503", 1.0)}
    for name, kind, _ in PER_MODEL.values():
        family = "tokenrouter_" + (name.removesuffix("_total") if kind == "counter" else name)
        assert found[family].type == kind, name
    steps = {(s.name, s.labels.get("model"), s.labels.get("le")): s.value for s in found["tokenrouter_step_seconds"].samples}
    assert steps["tokenrouter_step_seconds_count", "small", None] == 2
    assert steps["tokenrouter_step_seconds_bucket", "small", "0.005"] == 1
    assert steps["tokenrouter_step_seconds_bucket", "small", "+Inf"] == 2
    assert steps["tokenrouter_step_seconds_bucket", "large", "0.25"] == 0
    assert steps["tokenrouter_step_seconds_sum", "large", None] == 0.3
    assert len([k for k in steps if k[0].endswith("_bucket") and k[1] == "small"]) == len(STEP_BUCKETS) + 1


def test_steps_are_folded_once_and_the_stats_read_back():
    metrics = ServerMetrics(MODELS)
    window = {"small": [0.01], "large": []}
    metrics.render(engine_stats(), subservers(window))
    window["small"].append(0.02)
    text = metrics.render(engine_stats(free=5), subservers(window))
    count = [s.value for s in families(text)["tokenrouter_step_seconds"].samples
             if s.name == "tokenrouter_step_seconds_count" and s.labels["model"] == "small"]
    assert count == [2]
    stats = stats_from_text(text.decode(), MODELS)
    assert stats == engine_stats(free=5)


def test_each_server_has_its_own_registry():
    first, second = ServerMetrics(MODELS), ServerMetrics(MODELS)
    first.failed("/v1/completions", 400)
    text = second.render(engine_stats(), subservers({"small": [], "large": []}))
    assert b'outcome="400"' not in text


def test_the_server_answers_in_the_exposition_format(serve_inprocess):
    with serve_inprocess() as (svc, http, server):
        svc.generate("hi", policy="schedule:every=2", max_tokens=4)
        response = httpx.get(f"{http.url}/metrics")
        assert response.status_code == 200 and response.headers["content-type"] == CONTENT_TYPE_LATEST
        found = families(response.content)
        steps = [s for s in found["tokenrouter_step_seconds"].samples if s.name == "tokenrouter_step_seconds_count"]
        assert all(s.value > 0 for s in steps) and {s.labels["model"] for s in steps} == set(MODELS)
        assert server.stats()["active_requests"] == 0


def test_verification_counts_accepted_and_rolled_back_drafts():
    metrics = ServerMetrics(MODELS)
    out = finished({"small": 6, "large": 2}, 2)
    out.metrics.drafted, out.metrics.accepted = 9, 6
    metrics.finished("/v1/completions", out)
    found = families(metrics.render(engine_stats(), subservers({"small": [], "large": []})))
    assert found["tokenrouter_draft_tokens"].type == "counter"
    assert {s.labels["outcome"]: s.value for s in found["tokenrouter_draft_tokens"].samples
            if s.name.endswith("_total")} == {"accepted": 6.0, "rolled_back": 3.0}
