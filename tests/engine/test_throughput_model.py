"""The throughput model's arithmetic, its choice of tau, and the delayed-batching bound in the engine."""
from __future__ import annotations

import pytest

import tokenrouter
from tokenrouter.engine.throughput_model import StepProfile, ThroughputModel, verify_inputs

# a bandwidth-bound large model: a step costs nearly the same at any batch size
SMALL = StepProfile({1: 0.010, 4: 0.012, 16: 0.020}, {1: 0.010, 64: 0.030}, slowdown=0.8)
LARGE = StepProfile({1: 0.050, 4: 0.052, 16: 0.060}, {1: 0.050, 64: 0.120}, slowdown=0.8)


def test_all_small_is_concurrency_over_step_time():
    model = ThroughputModel(SMALL, LARGE)
    for c in (1, 4, 16):
        prediction = model.predict(c, 0.0)
        assert prediction.tokens_per_s == pytest.approx(c / SMALL.step_time(c))
        assert prediction.large_batch == 0


def test_more_large_share_costs_throughput():
    model = ThroughputModel(SMALL, LARGE)
    rates = [model.predict(16, p).tokens_per_s for p in (0.0, 0.1, 0.2, 0.4)]
    assert rates == sorted(rates, reverse=True)


def test_interpolation_between_and_beyond_profiled_points():
    assert SMALL.step_time(2.5) == pytest.approx(0.010 + 0.002 * 1.5 / 3)
    assert SMALL.step_time(32) == pytest.approx(0.020 + 0.008 / 12 * 16)
    assert LARGE.step_time(1, 64) == pytest.approx(0.050 + 0.070)


def test_a_step_costs_the_tokens_of_all_its_rows():
    # 4 rows of 16 tokens: 4 decode rows plus what 60 more tokens add to a chunk
    assert LARGE.step_time(4, 16) == pytest.approx(0.052 + (0.050 + 0.070 * 63 / 63) - (0.050 + 0.070 * 3 / 63))


def test_delay_pays_off_on_a_shared_device_and_respects_a_latency_bound():
    # models taking turns on one device: every large step streams its weights once, however many rows it has
    model = ThroughputModel(SMALL, LARGE, shared_device=True)
    best = model.choose_tau(16, 0.15)
    assert best.tau > 0
    assert best.tokens_per_s > model.predict(16, 0.15, 0.0).tokens_per_s
    assert best.large_batch > model.predict(16, 0.15, 0.0).large_batch
    bound = model.predict(16, 0.15, 0.0).tpot * 1.01
    assert model.choose_tau(16, 0.15, max_tpot=bound).tpot <= bound


def test_no_delay_without_contention_or_with_one_request():
    free = ThroughputModel(StepProfile(SMALL.decode, SMALL.chunk), StepProfile(LARGE.decode, LARGE.chunk))
    assert free.choose_tau(16, 0.15).tau == 0
    assert ThroughputModel(SMALL, LARGE).choose_tau(1, 0.15).tau == 0


def test_delayed_batching_never_holds_a_request_beyond_tau():
    tau = 0.03
    with tokenrouter.serve("config/tiny/pair.yaml", scheduler={"delay_tau_ms": tau * 1e3}) as svc:
        outs = svc.generate_batch([f"prompt {i}" for i in range(12)], concurrency=12,
                                  policy="random:share=0.2", max_tokens=24)
        large = svc.runtime.subservers["large"]
        assert sum(o.metrics.tokens_per_model["large"] for o in outs) > 0
        assert large.tau == tau and large.waited
        # the hold ends at tau at the latest; the margin covers the event loop's wake-up latency
        assert max(large.waited) <= tau + 0.05
        assert len(svc.runtime.subservers["small"].waited) == 0  # the home model never delays


def test_verify_inputs_from_acceptance_and_drafts():
    assert verify_inputs(1.0, 4) == {"large_share": pytest.approx(1 / 5), "catch_up": 5, "home_steps": pytest.approx(4 / 5)}
    assert verify_inputs(0.0, 4) == {"large_share": 1.0, "catch_up": 5, "home_steps": 4.0}
    half = verify_inputs(0.5, 2, route_step=True)  # 1 + 0.5 + 0.25 tokens a visit
    assert half["large_share"] == pytest.approx(1 / 1.75) and half["home_steps"] == pytest.approx(3 / 1.75)


def test_speculative_decoding_at_concurrency_one_beats_all_large_only_when_drafts_are_accepted():
    model = ThroughputModel(SMALL, LARGE, shared_device=True)
    all_large = 1 / LARGE.step_time(1)
    rates = [model.predict(1, **verify_inputs(a, 4)).tokens_per_s for a in (0.0, 0.5, 0.9)]
    assert rates == sorted(rates) and rates[0] < all_large < rates[-1]
