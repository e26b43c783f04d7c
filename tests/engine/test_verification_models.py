"""Verification on the tiny pair: `verify:every=k` writes all-large's output token for token, greedy and
sampled, under concurrency; the engine writes what the per-request loop writes; nothing is left behind."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import tokenrouter
from tokenrouter.bench.per_request import generate_one
from tokenrouter.engine.sampler import sample
from tokenrouter.engine.sequence import SamplingParams

PAIR = "config/tiny/pair.yaml"
PROMPTS = ["def add(a, b):", "hello", "The quick brown fox", "x" * 40, "Once upon a time", "import os\n",
           "Q: 2+2?", "SELECT * FROM t WHERE", "<html>", "fn main() {", "1, 2, 3,", "Dear Sir,", "# TODO",
           "while True:", "lorem ipsum dolor", "print(", "abc", "for i in range(", "{\"a\": 1,", "class A:"]


@pytest.fixture(scope="module")
def svc():
    service = tokenrouter.serve(PAIR)
    yield service
    service.close()


def assert_no_blocks_held(svc):
    for name, s in svc.stats().items():
        if name != "active_requests":
            assert s["free_blocks"] == s["total_blocks"], (name, s)
            assert s["waiting"] == s["running"] == s["parked"] == 0


def batch(svc, policy, concurrency, **kwargs):
    requests = [{"prompt": p, "max_tokens": 10 + 3 * (i % 5)} for i, p in enumerate(PROMPTS[:concurrency + 4])]
    return svc.generate_batch(requests, concurrency=concurrency, policy=policy, **kwargs)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_verify_every_k_greedy_equals_all_large(svc, k, concurrency):
    large = batch(svc, "all-large", concurrency)
    verified = batch(svc, f"verify:every={k}", concurrency)
    for a, v in zip(large, verified):
        assert v.token_ids == a.token_ids
        assert {r.model for r in v.tokens} <= set(svc.models)
        assert all(r.verified for r in v.tokens if r.model == svc.models[0])
    assert sum(v.metrics.drafted for v in verified) > 0  # (the tiny pair's random models rarely agree)
    assert_no_blocks_held(svc)


@pytest.mark.parametrize("policy", ["verify:every=3", "verify:of=confidence,threshold=0.6,hold=6",
                                    "verify:of=random,share=0.3", "verify:every=4,tolerance=0.3"])
def test_engine_equals_the_per_request_loop(svc, policy):
    outs = batch(svc, policy, 8)
    subs = svc.runtime.subservers
    executors, blocks = {m: subs[m].executor for m in svc.models}, {m: subs[m].blocks for m in svc.models}
    for i, out in enumerate(outs):
        ids, params, pol = svc.prepare(PROMPTS[i], policy, max_tokens=10 + 3 * (i % 5))
        ref = generate_one(executors, blocks, svc.runtime.eos_ids, ids, params, pol)
        assert out.token_ids == ref.output_ids
        assert [(r.model, r.verified, r.correction) for r in out.tokens] == \
               [(r.model, r.verified, r.correction) for r in ref.records]
    assert_no_blocks_held(svc)


def test_verify_of_confidence_writes_what_the_large_model_would_after_each_judged_prefix(svc):
    out = svc.generate("The quick brown fox", policy="verify:of=confidence,threshold=0.6", max_tokens=24)
    # every small token was accepted by the large model, every large token is its own choice after the same
    # prefix: so the whole output is the large model's greedy continuation
    assert out.token_ids == svc.generate("The quick brown fox", policy="all-large", max_tokens=24).token_ids


def test_sampled_verify_every_2_writes_all_large_and_follows_its_distribution(svc):
    """Per seed, the coupled draw makes verify:every=2 write exactly what all-large writes; over seeds, its
    first token follows the large model's next-token distribution (chi-square over fixed seeds: cannot flake)."""
    prompt, kwargs = "Once upon a time", dict(max_tokens=3, temperature=0.7, top_k=6, ignore_eos=True)
    seeds = range(300)
    verified = svc.generate_batch([{"prompt": prompt, "seed": s} for s in seeds], concurrency=16,
                                  policy="verify:every=2", **kwargs)
    large = svc.generate_batch([{"prompt": prompt, "seed": s} for s in seeds[:40]], concurrency=16,
                               policy="all-large", **kwargs)
    assert [v.token_ids for v in verified[:40]] == [a.token_ids for a in large]
    assert sum(v.metrics.drafted - v.metrics.accepted for v in verified) > 0  # some drafts were rejected
    ids = svc.encode(prompt)
    logits = torch.tensor(svc.runtime.subservers[svc.models[-1]].executor.call("prompt_logits", ids)[-1])
    probs = torch.softmax(logits / kwargs["temperature"], -1)
    top = torch.topk(probs, kwargs["top_k"])
    expected = top.values / top.values.sum() * len(seeds)
    counts = Counter(v.token_ids[0] for v in verified)
    assert set(counts) <= set(top.indices.tolist())
    chi2 = sum((counts.get(t, 0) - e) ** 2 / e for t, e in zip(top.indices.tolist(), expected.tolist()))
    assert chi2 < 20.5  # chi-square, 5 degrees of freedom, p = 0.001
    # and the sampler's own draws follow the distribution they were given (the coupling is a fair draw)
    draws = Counter(sample(logits[None].expand(len(seeds), -1),
                           [SamplingParams(temperature=0.7, top_k=6, seed=s) for s in seeds], [len(ids)] * len(seeds)))
    assert not math.isnan(chi2) and set(draws) <= set(top.indices.tolist())


def test_verification_metrics_add_up(svc):
    out = svc.generate("import os\n", policy="verify:every=4", max_tokens=30)
    m = out.metrics
    assert m.drafted >= m.accepted >= 0 and m.drafted > 0
    assert m.accepted == sum(r.verified for r in out.tokens)
    corrections = sum(r.correction for r in out.tokens)
    assert corrections <= m.drafted - m.accepted
    assert 0 <= m.acceptance_rate <= 1


@pytest.mark.parametrize("policy", ["verify:every=4,tolerance=0.3", "verify:of=random,share=0.3,tolerance=0.1"])
def test_a_tolerance_accepts_exactly_the_drafts_the_large_model_finds_likely_enough(svc, policy):
    """Lossy verification: recomputed with the large model over each output, every small token has at least
    `tolerance` times the probability of the large model's choice after the same prefix (strictly less would have
    been rolled back), every large token is its choice there; and some accepted drafts differ from all-large."""
    tolerance = float(policy.rsplit("=", 1)[1])
    outs = batch(svc, policy, 8)
    exact = batch(svc, policy.rsplit(",", 1)[0], 8)
    large = svc.runtime.subservers[svc.models[-1]].executor
    tolerated = 0
    for i, out in enumerate(outs):
        ids = svc.prepare(PROMPTS[i], policy, max_tokens=10 + 3 * (i % 5))[0]
        logits = torch.tensor(large.call("prompt_logits", ids + out.token_ids[:-1]))[len(ids) - 1:]
        for record, row in zip(out.tokens, logits):
            if record.model == svc.models[0]:
                assert record.verified
                ratio = math.exp(row[record.token_id] - row.max())
                assert ratio >= tolerance * (1 - 1e-4)
                assert record.tolerated == (record.token_id != int(row.argmax()))
                tolerated += record.tolerated
            else:
                assert record.token_id == int(row.argmax())
    assert tolerated > 0  # drafts the exact rule would have rolled back
    assert tolerated == sum(o.metrics.tolerated for o in outs)
    assert sum(o.metrics.drafted - o.metrics.accepted for o in outs) < \
        sum(o.metrics.drafted - o.metrics.accepted for o in exact)
    assert_no_blocks_held(svc)
