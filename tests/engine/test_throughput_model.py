"""The throughput model's arithmetic, its choice of tau, and the delayed-batching bound in the engine."""
from __future__ import annotations

import json
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

import tokenrouter
from tests.engine.test_verification import PROMPTS, serve, small_errs
from tokenrouter.engine.throughput_model import StepProfile, ThroughputModel, verify_inputs
from tokenrouter.policies import make_policy

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
    assert verify_inputs(1.0, 4) == {"large_share": pytest.approx(1 / 5), "catch_up": 5,
                                     "home_steps": pytest.approx(4 / 5), "verify": True}
    assert verify_inputs(0.0, 4) == {"large_share": 1.0, "catch_up": 5, "home_steps": 4.0, "verify": True}
    half = verify_inputs(0.5, 2, route_step=True)  # half the judged drafts accepted: 1 + 1 tokens a visit
    assert half["large_share"] == pytest.approx(1 / 2) and half["home_steps"] == pytest.approx(3 / 2)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_verify_inputs_fed_a_runs_acceptance_give_its_tokens_per_visit_and_home_steps(k):
    # what bench serve feeds the model: accepted / drafted counts every judged draft, those a rejection cut too
    runtime, seqs, _, workers = serve(PROMPTS, make_policy("verify", every=k), token=small_errs)
    drafted, accepted = sum(s.drafted for s in seqs), sum(s.accepted for s in seqs)
    output = sum(s.num_output_tokens for s in seqs)
    visits = sum(r.model == "large" for s in seqs for r in s.records)
    assert 0 < accepted < drafted
    inputs = verify_inputs(accepted / drafted, drafted / visits)
    assert 1 / inputs["large_share"] == pytest.approx(output / visits)
    assert inputs["home_steps"] == pytest.approx(len(workers["small"].rows) / output)


@pytest.mark.parametrize("shared", [True, False])
def test_at_concurrency_one_a_token_costs_its_own_steps_and_nothing_else(shared):
    # the one request is never at both models at once: it neither waits for nor is slowed by the other model
    model = ThroughputModel(SMALL, LARGE, shared_device=shared)
    inputs = verify_inputs(0.75, 4)
    own = inputs["home_steps"] * SMALL.step_time(1) + inputs["large_share"] * LARGE.step_time(1, 5)
    assert model.predict(1, **inputs).tpot == pytest.approx(own)
    assert model.predict(1, 0.15, catch_up=4).tpot == pytest.approx(SMALL.step_time(1) + 0.15 * LARGE.step_time(1, 4))


def test_on_a_shared_device_a_large_step_takes_the_hand_offs_of_one_home_step():
    # without delay, hand-offs reach the large model only as a home step ends, none during its own step
    model = ThroughputModel(SMALL, LARGE, shared_device=True)
    for c, p in ((4, 0.15), (16, 0.15), (16, 0.4)):
        prediction = model.predict(c, p)
        n, q = prediction.small_batch, p
        assert prediction.large_batch == pytest.approx(n * q / (1 - (1 - q) ** n))
    rates = [model.predict(c, 0.3).tokens_per_s for c in (1, 2, 4, 8, 16)]
    assert rates == sorted(rates)  # more requests fill both models' steps


def test_speculative_decoding_at_concurrency_one_beats_all_large_only_when_drafts_are_accepted():
    model = ThroughputModel(SMALL, LARGE, shared_device=True)
    all_large = 1 / LARGE.step_time(1)
    rates = [model.predict(1, **verify_inputs(a, 4)).tokens_per_s for a in (0.0, 0.5, 0.9)]
    assert rates == sorted(rates) and rates[0] < all_large < rates[-1]


def test_a_verifying_step_is_priced_from_its_own_measurements_where_the_profile_has_them():
    # rows of several tokens with logits at each: on the tiny pair 8 rows of 5 cost 1.8x what decode and chunk
    # times alone price them at
    verify = {3: {1: 0.052, 4: 0.070, 16: 0.110}, 9: {1: 0.056, 4: 0.090, 16: 0.200}}
    large = StepProfile(LARGE.decode, LARGE.chunk, LARGE.slowdown, verify)
    assert large.step_time(4, 3, verify=True) == pytest.approx(0.070)
    assert large.step_time(4, 5, verify=True) == pytest.approx(0.070 + 0.020 * 2 / 6)
    assert large.step_time(10, 9, verify=True) == pytest.approx(0.090 + 0.110 * 6 / 12)
    assert large.step_time(4, 1, verify=True) == large.step_time(4) == pytest.approx(0.052)
    assert large.step_time(4, 5) == LARGE.step_time(4, 5)  # a plain catch-up, and a profile without the table
    assert LARGE.step_time(4, 5, verify=True) == LARGE.step_time(4, 5)
    assert StepProfile.from_dict(json.loads(json.dumps(asdict(large)))) == large  # as cached
    inputs = verify_inputs(0.75, 4)
    tpot = ThroughputModel(SMALL, large, shared_device=True).predict(1, **inputs).tpot
    assert tpot == pytest.approx(inputs["home_steps"] * SMALL.step_time(1) + inputs["large_share"] * (0.052 + 0.004 * 2 / 6))


def test_the_profile_times_verifying_steps_of_each_row_length_and_batch():
    from tokenrouter.engine.throughput_model import VERIFY_BATCHES, VERIFY_ROWS, profile_runner

    class Runner:
        block_size = 4

        def __init__(self):
            self.steps = []

        def run(self, chunks):
            self.steps.append([(len(c.token_ids), c.num_outputs) for c in chunks])
            return SimpleNamespace(logits=torch.zeros(sum(c.num_outputs for c in chunks), 8))

    runner = Runner()
    profile = profile_runner(runner, repeat=1)
    assert sorted(profile.verify) == sorted(VERIFY_ROWS)
    assert all(sorted(t) == sorted(VERIFY_BATCHES) for t in profile.verify.values())
    for n in VERIFY_ROWS:
        for b in VERIFY_BATCHES:
            assert [(n, n)] * b in runner.steps


@pytest.mark.parametrize("shared", [True, False])
def test_stopping_at_the_fixed_point_predicts_what_every_iteration_does(monkeypatch, shared):
    from tokenrouter.engine import throughput_model

    model = ThroughputModel(SMALL, LARGE, max_batch=16, shared_device=shared)
    cases = [(c, p, tau) for c in (1, 4, 16, 64) for p in (0.0, 0.15, 0.5) for tau in (0.0, 0.01)]
    early = [model.predict(*case) for case in cases]
    monkeypatch.setattr(throughput_model, "CONVERGED", -1.0)  # never converged: all MAX_ITERATIONS run
    full = [model.predict(*case) for case in cases]
    for a, b in zip(early, full):
        assert a.tokens_per_s == pytest.approx(b.tokens_per_s, rel=1e-9)
        assert a.large_batch == pytest.approx(b.large_batch, rel=1e-9, abs=1e-12)


def test_a_profile_measured_on_a_busy_machine_is_not_cached(tmp_path, monkeypatch):
    from tokenrouter.engine import throughput_model
    from tokenrouter.models import kernels_timing

    profile = StepProfile({1: 0.01}, {1: 0.01})
    share = {"value": 0.5}
    monkeypatch.setattr(kernels_timing, "others_share", lambda before, after, ours=0.0: share["value"])
    path = tmp_path / "p.json"
    assert throughput_model.load_or_profile(path, lambda: profile) == profile and not path.exists()
    share["value"] = 0.05  # quiet: cached, and read back at the next start without measuring
    assert throughput_model.load_or_profile(path, lambda: profile) == profile and path.exists()
    assert throughput_model.load_or_profile(path, lambda: 1 / 0) == profile


def test_a_workers_own_cpu_time_is_not_counted_as_others():
    import os
    import subprocess
    import sys

    from tokenrouter.engine.throughput_model import _cpu_seconds

    spin = "import sys, time\nwhile time.process_time() < 0.3: pass\nprint('spun', flush=True)\nsys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "spun\n"
        assert _cpu_seconds((child.pid,)) >= 0.25  # a worker's CPU time, read from /proc
    finally:
        child.communicate("")
    assert _cpu_seconds((os.getpid(),)) == 0.0  # this process is counted as its own already
    assert _cpu_seconds((999_999_999,)) == 0.0  # no such process


def test_a_smaller_step_measured_slower_than_a_larger_one_takes_the_larger_ones_time():
    p = StepProfile({1: 0.385, 2: 0.269, 4: 0.183, 8: 0.245, 16: 0.337}, {1: 0.23, 4: 0.19, 16: 0.31},
                    verify={3: {1: 0.2, 4: 0.1}})
    assert p.decode == {1: 0.183, 2: 0.183, 4: 0.183, 8: 0.245, 16: 0.337}
    assert p.chunk == {1: 0.19, 4: 0.19, 16: 0.31} and p.verify == {3: {1: 0.1, 4: 0.1}}
    assert StepProfile.from_dict(asdict(p)) == p


def test_a_profile_taken_on_the_avx2_kernels_is_cached_apart(monkeypatch, tmp_path):
    """TOKENROUTER_ISA=avx2 gives the models other kernels, so its step profiles are cached under other keys
    than the same config's on every kernel the CPU has (and those keep theirs)."""
    from tokenrouter.config import load_config
    from tokenrouter.engine import throughput_model

    config = load_config("config/tiny/pair.yaml")
    profile = StepProfile({1: 0.01, 2: 0.012}, {1: 0.01, 4: 0.02})
    executors = {m.name: SimpleNamespace(name=m.name, info=SimpleNamespace(pid=0), call=lambda what, *a: 1,
                                         shares_device_with=lambda other: True) for m in config.models}
    paths = []
    monkeypatch.setattr(throughput_model, "load_or_profile", lambda path, make, pids=(): paths.append(path) or profile)
    dirs = {m.name: tmp_path for m in config.models}
    for isa in ("", "avx2", ""):
        monkeypatch.setenv("TOKENROUTER_ISA", isa)
        throughput_model.profiled_model(config, executors, dirs)
    every, avx2, again = paths[:2], paths[2:4], paths[4:]
    assert every == again and not set(every) & set(avx2)
    # a changed native kernel (its source, flags or torch) steps at other speeds: profiled again
    from tokenrouter.models import native
    monkeypatch.setattr(native, "version", lambda: "int4-vnni=changed,avx2=changed")
    throughput_model.profiled_model(config, executors, dirs)
    assert not set(paths[6:]) & set(every)
