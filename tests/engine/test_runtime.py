"""The routing engine against the per-request loop, catch-up arithmetic, aborts, preemption, validation."""
from __future__ import annotations

import asyncio

import pytest
import torch

import tokenrouter
from tokenrouter.bench.per_request import generate_one
from tokenrouter.engine.sequence import SamplingParams

PAIR = "config/tiny/pair.yaml"
DETERMINISTIC = ["all-small", "all-large", "schedule:every=3", "random:share=0.3"]
PROMPTS = ["def add(a, b):", "hello", "The quick brown fox", "x" * 40, "Once upon a time", "import os\n",
           "Q: 2+2?", "SELECT * FROM t WHERE", "<html>", "fn main() {", "1, 2, 3,", "Dear Sir,", "# TODO",
           "while True:", "lorem ipsum dolor", "print("]


@pytest.fixture(scope="module")
def svc():
    service = tokenrouter.serve(PAIR)
    yield service
    service.close()


def per_request(svc, prompt: str, policy: str, max_tokens: int):
    subs = svc.runtime.subservers
    executors = {m: subs[m].executor for m in svc.models}
    blocks = {m: subs[m].blocks for m in svc.models}
    ids, params, pol = svc.prepare(prompt, policy, max_tokens=max_tokens)
    return generate_one(executors, blocks, svc.runtime.eos_ids, ids, params, pol)


def assert_no_blocks_held(svc):
    for name, s in svc.stats().items():
        if name != "active_requests":
            assert s["free_blocks"] == s["total_blocks"], (name, s)
            assert s["waiting"] == s["running"] == s["parked"] == 0


@pytest.mark.parametrize("policy", DETERMINISTIC)
@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_engine_tokens_equal_per_request_loop(svc, policy, concurrency):
    # more requests than slots, with different prompt lengths and max_tokens: arrivals are staggered
    # as slots free up, so hand-offs, prefills and decodes of different requests share steps.
    requests = [{"prompt": p, "max_tokens": 6 + 3 * (i % 5)} for i, p in enumerate(PROMPTS[:concurrency + 4])]
    outs = svc.generate_batch(requests, concurrency=concurrency, policy=policy)
    for request, out in zip(requests, outs):
        ref = per_request(svc, request["prompt"], policy, request["max_tokens"])
        assert out.token_ids == ref.output_ids
        assert [r.model for r in out.tokens] == [r.model for r in ref.records]
    assert_no_blocks_held(svc)


def test_each_model_computes_only_the_tokens_it_missed(svc):
    out = svc.generate("The quick brown fox", policy="schedule:every=3", max_tokens=14)
    p, n = out.prompt_tokens, len(out.tokens)
    # the home model decides every position: it runs the prompt and every output token but the last
    assert out.metrics.tokens_computed["small"] == p + n - 1
    # the large model catches up from its watermark each time: in total, everything before its last token
    last_large = max(i for i, r in enumerate(out.tokens) if r.model == "large")
    assert out.metrics.tokens_computed["large"] == p + last_large
    assert out.metrics.handoffs == sum(r.model == "large" for r in out.tokens) == n // 3


def test_all_large_equals_transformers_generate(svc):
    from transformers import AutoModelForCausalLM

    from tokenrouter.models.sources import resolve_model_dir

    out = svc.generate("def add(a, b):", policy="all-large", max_tokens=20, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir("tiny:qwen2-large"), dtype=torch.float32).eval()
    ids = svc.encode("def add(a, b):")
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(ids):].tolist()
    assert out.token_ids == ref


def test_stream_abort_frees_blocks_in_both_models(svc):
    async def consume():
        got = []
        async for record in svc.stream("Once upon a time", policy="schedule:every=2", max_tokens=200,
                                       ignore_eos=True):
            got.append(record)
            if len(got) == 7:
                break
        return got

    got = asyncio.run(consume())
    assert {r.model for r in got} == {"small", "large"}
    svc.generate("hi", max_tokens=2)  # one more request passes step boundaries in both subservers
    svc.generate("hi", policy="all-large", max_tokens=2)
    assert_no_blocks_held(svc)
    for sub in svc.runtime.subservers.values():  # no worker keeps the abandoned request's state beyond the
        known, _ = sub.executor.call("num_known")  # forgets still waiting for its next step
        assert not sub.executor.known and known == len(sub.executor._forget)


def test_sampling_is_seeded_and_batch_independent(svc):
    kwargs = dict(policy="random:share=0.3", max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=7)
    a = svc.generate("hello", **kwargs)
    b = svc.generate_batch(["hello", "other", "prompts"], concurrency=3, **kwargs)[0]
    assert a.token_ids == b.token_ids
    assert svc.generate("hello", **{**kwargs, "seed": 8}).token_ids != a.token_ids


def test_stop_string_and_stop_token(svc):
    out = svc.generate("hello", max_tokens=30, ignore_eos=True)
    stop_text = out.text[5:8]
    stopped = svc.generate("hello", max_tokens=30, ignore_eos=True, stop=[stop_text])
    assert stopped.finish_reason == "stop" and stopped.text == out.text[:out.text.index(stop_text)]
    token = out.token_ids[4]
    by_token = svc.generate("hello", max_tokens=30, ignore_eos=True, stop_token_ids=[token])
    assert by_token.finish_reason == "stop" and by_token.token_ids[-1] == token


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"policy": "no-such-policy"}, "policy"), ({"max_tokens": 5000}, "max_tokens"),
])
def test_bad_requests_raise_naming_the_field(svc, kwargs, field):
    with pytest.raises(ValueError, match=field):
        svc.generate("hello", **kwargs)
    assert_no_blocks_held(svc)


def test_preemption_by_recompute_keeps_outputs_and_frees_blocks():
    # 24 blocks of 4 tokens per model: 16 concurrent requests of ~30 tokens cannot all stay resident
    svc = tokenrouter.serve(PAIR, models=[
        {"name": "small", "source": "tiny:qwen2-small", "block_size": 4, "num_kv_blocks": 24},
        {"name": "large", "source": "tiny:qwen2-large", "block_size": 4, "num_kv_blocks": 24}])
    try:
        requests = [{"prompt": p, "max_tokens": 12} for p in PROMPTS]
        outs = svc.generate_batch(requests, concurrency=16, policy="schedule:every=3")
        stats = svc.stats()
        assert stats["small"]["preemptions"] + stats["large"]["preemptions"] > 0
        for request, out in zip(requests, outs):
            assert out.token_ids == per_request(svc, request["prompt"], "schedule:every=3", 12).output_ids
        assert_no_blocks_held(svc)
    finally:
        svc.close()


def test_overload_is_refused():
    svc = tokenrouter.serve(PAIR, scheduler={"max_queued_requests": 2})
    try:
        outs = svc.generate_batch(PROMPTS[:3], concurrency=3, max_tokens=50)
        assert [o.finish_reason for o in outs].count("error") == 1
        assert "overloaded" in next(o.error for o in outs if o.error)
        assert svc.generate("hi", max_tokens=2).finish_reason in ("length", "stop")  # admitted once idle
        assert_no_blocks_held(svc)
    finally:
        svc.close()


def test_a_failed_step_fails_every_request_fast_and_frees_blocks():
    from tokenrouter.engine.runtime import EngineFailed

    svc = tokenrouter.serve(PAIR)
    try:
        large = svc.runtime.subservers["large"].executor.runner
        calls = {"n": 0}
        real_run = large.run

        def flaky(chunks):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("simulated device fault")
            return real_run(chunks)

        large.run = flaky
        outs = svc.generate_batch(PROMPTS[:6], concurrency=6, policy="schedule:every=2", max_tokens=20)
        assert all(o.finish_reason == "abort" for o in outs)
        assert "simulated device fault" in svc.error and svc.error.startswith("large:")
        with pytest.raises(EngineFailed, match="simulated device fault"):
            svc.generate("hi", max_tokens=2)
        for name in svc.models:
            blocks = svc.runtime.subservers[name].blocks
            assert blocks.num_free_blocks == blocks.num_blocks
    finally:
        svc.close()


def test_sampling_params_validate():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)


@pytest.mark.parametrize("policy", ["schedule:every=3", "random:share=0.3", "all-large"])
def test_lockstep_baseline_writes_the_same_tokens(svc, policy):
    from tokenrouter.bench.lockstep import generate_lockstep

    subs = svc.runtime.subservers
    requests = [svc.prepare(p, policy, max_tokens=10)[:2] for p in PROMPTS[:6]]
    outs = svc.generate_batch([{"prompt": p, "max_tokens": 10} for p in PROMPTS[:6]], concurrency=4, policy=policy)
    seqs = generate_lockstep({m: subs[m].executor for m in svc.models}, {m: subs[m].blocks for m in svc.models},
                             svc.runtime.eos_ids, requests, svc.policy(policy), concurrency=4)
    for out, seq in zip(outs, seqs):
        assert out.token_ids == seq.output_ids
        assert [r.model for r in out.tokens] == [r.model for r in seq.records]
    assert_no_blocks_held(svc)


@pytest.mark.parametrize("ids", [[-1], [10**9], [5, 259], [1, True]])
def test_out_of_range_token_ids_are_refused_before_admission(svc, ids):
    with pytest.raises(ValueError, match="token id"):
        svc.generate(ids, max_tokens=2)
    assert svc.error is None and svc.generate([5, 6, 7], max_tokens=2).finish_reason == "length"
    assert_no_blocks_held(svc)


def test_a_vanishing_temperature_is_greedy_and_harms_nobody(svc):
    greedy = svc.generate("hello", max_tokens=8, policy="schedule:every=2")
    tiny = svc.generate("hello", max_tokens=8, policy="schedule:every=2", temperature=1e-38, seed=1)
    assert tiny.token_ids == greedy.token_ids and svc.error is None


def test_non_finite_logits_end_only_their_own_request():
    # a model that goes numerically wrong on one sequence (here: forced nan for a prompt holding byte 7)
    with tokenrouter.serve(PAIR) as svc:
        runner = svc.executors["small"].runner
        run = runner.run

        def poisoned(chunks):
            out = run(chunks)
            out.logits = out.logits.clone()
            for i, chunk in enumerate(chunks):
                if 7 in chunk.token_ids:
                    out.logits[out.offsets[i]:out.offsets[i] + chunk.num_outputs] = float("nan")
            return out

        runner.run = poisoned
        alone = svc.generate("hello there", policy="all-small", max_tokens=10, ignore_eos=True)
        outs = svc.generate_batch([[104, 7, 105], "hello there", {"prompt": [104, 7, 106], "temperature": 0.8}],
                                  concurrency=3, policy="all-small", max_tokens=10, ignore_eos=True)
        for bad in (outs[0], outs[2]):
            assert bad.finish_reason == "abort" and bad.token_ids == []
        assert outs[1].token_ids == alone.token_ids and outs[1].finish_reason == "length"
        assert svc.error is None and svc.generate("hi", max_tokens=3).finish_reason in ("length", "stop")
        assert_no_blocks_held(svc)


class ChoiceRecorder:
    """A throughput model that records what the runtime asks it and chooses tau 0."""

    def __init__(self):
        self.calls = []

    def choose_tau(self, concurrency, large_share, max_tpot=0.0, catch_up=None, home_steps=1.0, verify=False):
        self.calls.append({"large_share": large_share, "catch_up": catch_up, "home_steps": home_steps})
        return type("Choice", (), {"tau": 0.0})


@pytest.mark.parametrize("policy, send", [("verify:every=4", None), ("verify:of=all-small,hold=6", 3),
                                          ("all-small", 3)])
def test_tau_is_chosen_from_the_runs_visits_and_home_steps_per_token(monkeypatch, policy, send):
    # a verifying policy's token costs several home steps and a visit writes several tokens: update_tau sees both,
    # as verify_inputs gives them from the run's acceptance and drafts per visit; a routed one's costs one home step
    from tests.engine.test_verification import PROMPTS as IDS, serve, small_errs
    from tokenrouter.engine import runtime as runtime_module
    from tokenrouter.engine.throughput_model import verify_inputs
    from tokenrouter.policies import parse_policy

    monkeypatch.setattr(runtime_module, "TAU_EVERY", 10 ** 9)  # one choice, after the run, over all of it
    every = (lambda view, model: model == "small" and view.num_output_tokens % send == send - 1) if send else None
    runtime, seqs, _, _ = serve(IDS, parse_policy(policy), token=small_errs, **({"send": every} if send else {}))
    runtime.throughput_model = recorder = ChoiceRecorder()
    runtime.update_tau()
    (seen,) = recorder.calls
    visits = sum(r.model == "large" for s in seqs for r in s.records)
    assert seen["large_share"] == pytest.approx(visits / sum(s.num_output_tokens for s in seqs))
    drafted, accepted = sum(s.drafted for s in seqs), sum(s.accepted for s in seqs)
    if drafted:
        expected = verify_inputs(accepted / drafted, drafted / visits, route_step=policy.startswith("verify:of"))
        assert seen["home_steps"] > 1 and seen["large_share"] == pytest.approx(expected["large_share"])
        # (verify:of: a visit that the hold or a finishing draft forced had no route step)
        assert seen["home_steps"] == pytest.approx(expected["home_steps"], rel=0.02)
    else:
        assert seen["home_steps"] == pytest.approx(1.0)
