"""Cost attribution per request, run cost per completed task, activated parameters per token."""
from __future__ import annotations

import math

import pytest

from tokenrouter.bench.cost import (ModelUsage, activated_parameters, attributed_cost, between, home_model,
                                    parameters, prices, request_cost, run_cost, usage)
from tokenrouter.engine.sequence import TokenRecord
from tokenrouter.service.output import RequestMetrics, RoutedOutput

MODELS = ["small", "large"]


def canned(writers: str, computed: dict[str, int]) -> RoutedOutput:
    """An output whose tokens were written by the models named in `writers` ("s" small, "l" large)."""
    records = [TokenRecord(i, "x", "small" if w == "s" else "large", math.nan, 0.1 * i) for i, w in enumerate(writers)]
    handoffs = writers.count("l")
    metrics = RequestMetrics.from_records(records, MODELS, handoffs, computed, 1.0)
    return RoutedOutput("x" * len(writers), records, "length", 5, "test", MODELS, metrics)


def test_attributed_cost_is_tokens_times_seconds_per_token_times_price():
    used = {"small": ModelUsage(busy_seconds=10.0, tokens=1000), "large": ModelUsage(busy_seconds=30.0, tokens=300)}
    per_second = {"small": 3.6 / 3600, "large": 36.0 / 3600}
    out = canned("sssl", {"small": 8, "large": 6})
    expected = 8 * 0.01 * 0.001 + 6 * 0.1 * 0.01
    assert attributed_cost(out, used, per_second) == pytest.approx(expected)


def test_a_model_that_never_ran_costs_nothing():
    used = {"small": ModelUsage(2.0, 100), "large": ModelUsage(0.0, 0)}
    assert used["large"].seconds_per_token == 0.0
    out = canned("ssss", {"small": 9})
    assert attributed_cost(out, used, {"small": 1.0, "large": 5.0}) == pytest.approx(9 * 0.02)


def test_run_cost_divides_priced_busy_time_by_completed_tasks():
    before = {"small": ModelUsage(1.0, 10), "large": ModelUsage(2.0, 5)}
    after = {"small": ModelUsage(5.0, 50), "large": ModelUsage(4.0, 9)}
    cost = run_cost(before, after, {"small": 0.5, "large": 2.0}, completed=4)
    assert cost.busy_seconds == {"small": 4.0, "large": 2.0}
    assert cost.dollars == pytest.approx(4 * 0.5 + 2 * 2.0)
    assert cost.per_completed_task == pytest.approx(6.0 / 4)
    # failed tasks add cost and no quality: fewer completions, same dollars, higher cost per task
    assert run_cost(before, after, {"small": 0.5, "large": 2.0}, completed=2).per_completed_task == pytest.approx(3.0)
    assert run_cost(before, after, {"small": 0.5, "large": 2.0}, completed=0).per_completed_task == math.inf
    assert run_cost(before, before, {"small": 0.5, "large": 2.0}, completed=0).per_completed_task == 0.0
    with pytest.raises(ValueError, match="completed"):
        run_cost(before, after, {"small": 0.5, "large": 2.0}, completed=-1)


def test_home_model_is_the_first_model_that_ran():
    assert home_model(canned("ssls", {"small": 9, "large": 7})) == "small"
    assert home_model(canned("llll", {"large": 8})) == "large"


def test_activated_parameters_count_the_home_model_on_every_token():
    params = {"small": 100, "large": 1000}
    routed = canned("sssl", {"small": 8, "large": 6})  # small decides 4 positions, large writes 1
    assert activated_parameters([routed], params) == pytest.approx((4 * 100 + 1000) / 4)
    all_large = canned("ll", {"large": 6})
    assert activated_parameters([all_large], params) == 1000
    assert activated_parameters([routed, all_large], params) == pytest.approx((4 * 100 + 1000 + 2 * 1000) / 6)
    assert activated_parameters([], params) == 0.0


def test_request_costs_add_up_to_the_run_cost(svc):
    # every token a model ran forward is attributed to exactly one request, so priced with the run's own
    # seconds per token the requests of a run sum to the run's priced busy time
    before = usage(svc)
    outs = svc.generate_batch(["def f(x):", "hello world", "1, 2, 3"], concurrency=3,
                              policy="schedule:every=3", max_tokens=9)
    after = usage(svc)
    per_request = [request_cost(o, svc, between(before, after)) for o in outs]
    run = run_cost(before, after, prices(svc), completed=len(outs))
    assert all(c > 0 for c in per_request)
    assert sum(per_request) == pytest.approx(run.dollars)
    assert run.busy_seconds["large"] > 0 and run.busy_seconds["small"] > 0


def test_parameters_and_prices_come_from_the_runners_and_config(svc):
    params = parameters(svc)
    assert set(params) == {"small", "large"} and params["small"] < params["large"]
    assert prices(svc) == pytest.approx({"small": 0.1 / 3600, "large": 0.3 / 3600})
    out = svc.generate("abc", policy="all-large", max_tokens=4)
    assert activated_parameters([out], params) == params["large"]
    assert request_cost(out, svc) > 0


def test_query_level_tokens_count_only_the_writer():
    params = {"small": 100, "large": 1000}
    moved = canned("llll", {"small": 5, "large": 9})  # the small model read the prompt, then sent it for good
    assert activated_parameters([moved], params, home_decides=False) == 1000
    assert activated_parameters([canned("ss", {"small": 6})], params, home_decides=False) == 100
    late = canned("llll", {"small": 8, "large": 9})  # the small model wrote 3 tokens, then the decision dropped them
    late.metrics.discarded_tokens = 3
    assert activated_parameters([late], params, home_decides=False) == pytest.approx((3 * 100 + 4 * 1000) / 4)
