"""Query-level routers through the engine: one model writes every token of a response, the same tokens
the per-request loop writes; decisions on constructed inputs."""
from __future__ import annotations

import pytest
import torch

import tokenrouter
from tokenrouter.bench.per_request import generate_one
from tokenrouter.policies import StepFeatures, make_policy, parse_policy

from conftest import make_seq, peaked

PAIR = "config/tiny/pair.yaml"
PROMPTS = ["def add(a, b):", "hello", "The quick brown fox", "Once upon a time", "import os\n", "Q: 2+2?",
           "SELECT * FROM t", "<html>", "fn main() {", "1, 2, 3,", "Dear Sir,", "# TODO"]


@pytest.fixture(scope="module")
def svc():
    service = tokenrouter.serve(PAIR)
    yield service
    service.close()


def per_request(svc, prompt: str, policy, max_tokens: int):
    subs = svc.runtime.subservers
    ids, params, _ = svc.prepare(prompt, max_tokens=max_tokens, ignore_eos=True)
    return generate_one({m: subs[m].executor for m in svc.models}, {m: subs[m].blocks for m in svc.models},
                        svc.runtime.eos_ids, ids, params, policy)


def confidence_splitting(svc) -> float:
    """A query-confidence threshold that sends about half of PROMPTS to the large model: the median of
    their scores, read from a run where every prompt's first token records its query score."""
    outs = svc.generate_batch(PROMPTS, policy=make_policy("query-confidence", threshold=1.0), max_tokens=1)
    scores = sorted(o.tokens[0].score for o in outs)
    return 1 - (scores[len(scores) // 2 - 1] + scores[len(scores) // 2]) / 2


@pytest.mark.parametrize("spec", ["query-random:share=0.5,seed=3", "query-confidence"])
def test_every_token_of_a_response_comes_from_one_model(svc, spec):
    if spec == "query-confidence":
        policy = make_policy("query-confidence", threshold=confidence_splitting(svc))
    else:
        policy = svc.policy(spec)
    outs = svc.generate_batch(PROMPTS, concurrency=6, policy=policy, max_tokens=10, ignore_eos=True)
    writers = [{r.model for r in out.tokens} for out in outs]
    assert all(len(w) == 1 for w in writers), writers
    assert {"small"} in writers and {"large"} in writers  # the decision differs across prompts
    for prompt, out in zip(PROMPTS, outs):
        ref = per_request(svc, prompt, policy, 10)
        assert out.token_ids == ref.output_ids
        assert [r.model for r in out.tokens] == [r.model for r in ref.records]
        if out.tokens[0].model == "large":
            # the whole response moved: at most one hand-off, and the small model never decoded
            assert out.metrics.handoffs <= 1
            assert out.metrics.tokens_computed.get("small", 0) <= out.prompt_tokens


def test_query_random_decides_by_prompt_at_admission():
    policy = make_policy("query-random", share=0.5, seed=1)
    homes = {policy.home(["small", "large"], [i, i + 1]) for i in range(64)}
    assert homes == {"small", "large"}
    assert policy.home(["small", "large"], [5, 6]) == policy.home(["small", "large"], [5, 6])
    assert make_policy("query-random", share=0.0).home(["small", "large"], [1]) == "small"
    assert make_policy("query-random", share=1.0).home(["small", "large"], [1]) == "large"


def test_query_confidence_decides_once_from_the_prompt_and_keeps_the_decision():
    policy = make_policy("query-confidence", threshold=0.9)
    sure, unsure = make_seq([1]), make_seq([2])
    first = StepFeatures(torch.stack([peaked(16, 0, 20.0), torch.zeros(16)]), torch.zeros(2, 4), [sure, unsure])
    sends, scores = policy.route(first)
    assert sends == [False, True]
    # later positions: features that would flip the decision are ignored
    sure.token_ids.append(3)
    unsure.token_ids.append(3)
    later = StepFeatures(torch.stack([torch.zeros(16), peaked(16, 0, 20.0)]), torch.zeros(2, 4), [sure, unsure])
    assert policy.route(later) == (sends, scores)


def test_query_levels_and_moves_home():
    for name in ("query-random", "query-confidence"):
        policy = make_policy(name)
        assert policy.level == "query" and policy.moves_home
    assert make_policy("entropy").level == "token" and not make_policy("entropy").moves_home


@pytest.mark.parametrize("spec", ["query-random:share=0.4", "query-confidence:threshold=0.7"])
def test_batched_scores_equal_one_at_a_time(spec):
    torch.manual_seed(0)
    logits, seqs = torch.randn(6, 16) * 3, [make_seq([i, i + 2]) for i in range(6)]
    whole = parse_policy(spec).scores(StepFeatures(logits, torch.zeros(6, 4), seqs))
    single = parse_policy(spec)
    rows = [single.scores(StepFeatures(logits[i:i + 1], torch.zeros(1, 4), seqs[i:i + 1])) for i in range(6)]
    torch.testing.assert_close(whole, torch.cat(rows))


def test_a_response_moved_to_the_large_model_frees_the_small_models_blocks_at_once(svc):
    import asyncio

    async def first_token_then_stats():
        stream = svc.stream("Once upon a time", policy=make_policy("query-confidence", threshold=1.0),
                            max_tokens=50, ignore_eos=True)
        async for record in stream:
            assert record.model == "large"
            stats = svc.stats()
            await stream.aclose()
            return stats

    small = asyncio.run(first_token_then_stats())["small"]
    assert small["parked"] == 0 and small["free_blocks"] == small["total_blocks"]


def test_query_confidence_over_the_first_tokens_decides_once_after_k():
    policy = make_policy("query-confidence", threshold=0.6, tokens=2)
    assert policy.decides_after == 2 and policy.level == "query"
    sure, unsure = make_seq([1]), make_seq([2])
    confident, flat = peaked(16, 0, 20.0), torch.zeros(16)
    for step in range(2):  # while the small model writes its first two tokens, nothing is sent
        sends, scores = policy.route(StepFeatures(torch.stack([confident, flat]), torch.zeros(2, 4), [sure, unsure]))
        assert sends == [False, False] and all(s != s for s in scores)  # nan: not decided
        if step == 0:  # the same position asked again (a step repeated after a preemption) counts once
            policy.route(StepFeatures(torch.stack([confident, flat]), torch.zeros(2, 4), [sure, unsure]))
            assert len(policy.top1.get(sure)) == 1
        sure.token_ids.append(3)
        unsure.token_ids.append(3)
    sends, scores = policy.route(StepFeatures(torch.stack([flat, confident]), torch.zeros(2, 4), [sure, unsure]))
    assert sends == [False, True]  # the mean over the first two tokens, not the features now
    assert scores[1] == pytest.approx(1 - 1 / 16, abs=1e-6)
    sure.token_ids.append(3)
    assert policy.route(StepFeatures(torch.stack([flat, flat]), torch.zeros(2, 4), [sure, unsure]))[0] == sends
    with pytest.raises(ValueError, match="tokens"):
        make_policy("query-confidence", tokens=-1)


def first_tokens_splitting(svc, k: int) -> float:
    """A threshold for query-confidence:tokens=k that sends about half of PROMPTS: the median mean top-1
    probability of the small model over the first k tokens of its own answers."""
    outs = svc.generate_batch(PROMPTS, policy="all-small", max_tokens=k + 1, ignore_eos=True)
    ids = [svc.encode(p) for p in PROMPTS]
    runner = svc.runtime.subservers["small"].executor.runner
    means = []
    for prompt, out in zip(ids, outs):
        probe = make_policy("query-confidence", threshold=0.0, tokens=k)
        seq = make_seq(prompt)
        for t in range(k + 1):
            logits = forced_logits(runner, prompt + out.token_ids[:t])
            score = probe.scores(StepFeatures(logits[None], torch.zeros(1, 4), [seq]))[0]
            seq.token_ids.append(out.token_ids[t])
        means.append(1 - float(score))
    means.sort()
    return (means[len(means) // 2 - 1] + means[len(means) // 2]) / 2


def forced_logits(runner, ids: list[int]) -> torch.Tensor:
    from tokenrouter.engine.block_manager import BlockManager
    from tokenrouter.training.labels import forced_outputs

    blocks = BlockManager(runner.num_blocks, runner.block_size)
    (logits, _), = forced_outputs(runner, blocks, [ids], [[0]])
    return logits[0]


def test_first_tokens_are_held_back_and_dropped_when_the_large_model_takes_the_response(svc):
    k = 3
    policy = make_policy("query-confidence", threshold=first_tokens_splitting(svc, k), tokens=k)
    kwargs = {"max_tokens": 10, "ignore_eos": True}
    outs = svc.generate_batch(PROMPTS, concurrency=6, policy=policy, **kwargs)
    small = svc.generate_batch(PROMPTS, concurrency=6, policy="all-small", **kwargs)
    large = svc.generate_batch(PROMPTS, concurrency=6, policy="all-large", **kwargs)
    writers = [{r.model for r in out.tokens} for out in outs]
    assert {"small"} in writers and {"large"} in writers  # the decision differs across prompts
    for prompt, out, s, g in zip(PROMPTS, outs, small, large):
        assert len({r.model for r in out.tokens}) == 1
        moved = out.tokens[0].model == "large"
        # one model writes the whole response: the large model's own, from its first token
        assert out.token_ids == (g if moved else s).token_ids
        assert out.metrics.discarded_tokens == (k if moved else 0)
        assert out.metrics.tokens_computed["small"] == out.prompt_tokens + (k if moved else len(out.tokens) - 1)
        ref = per_request(svc, prompt, policy, 10)
        assert out.token_ids == ref.output_ids and ref.discarded == out.metrics.discarded_tokens
        assert [r.model for r in out.tokens] == [r.model for r in ref.records]
    stats = svc.stats()
    assert all(stats[m]["free_blocks"] == stats[m]["total_blocks"] for m in svc.models)


def test_a_stream_never_shows_the_dropped_tokens(svc):
    import asyncio

    k = 3
    policy = make_policy("query-confidence", threshold=first_tokens_splitting(svc, k), tokens=k)
    outs = svc.generate_batch(PROMPTS, policy=policy, max_tokens=8, ignore_eos=True)
    moved = next(p for p, o in zip(PROMPTS, outs) if o.tokens[0].model == "large")
    kept = next(p for p, o in zip(PROMPTS, outs) if o.tokens[0].model == "small")

    async def read(prompt):
        return [r async for r in svc.stream(prompt, policy=policy, max_tokens=8, ignore_eos=True)]

    kept_records, moved_records = asyncio.run(read(kept)), asyncio.run(read(moved))
    assert [r.model for r in kept_records] == ["small"] * 8 and [r.model for r in moved_records] == ["large"] * 8
    # kept: the first k tokens reach the reader together, when the decision is taken (k + 1 is written then)
    assert kept_records[0].t == kept_records[k].t < kept_records[k + 1].t
    # moved: the large model's tokens are released one by one as it writes them
    times = [r.t for r in moved_records]
    assert times == sorted(set(times))


def test_the_lockstep_baseline_refuses_a_policy_that_restarts_responses(svc):
    from tokenrouter.bench.lockstep import generate_lockstep

    subs = svc.runtime.subservers
    ids, params, _ = svc.prepare("hello", max_tokens=4)
    with pytest.raises(ValueError, match="lockstep"):
        generate_lockstep({m: subs[m].executor for m in svc.models}, {m: subs[m].blocks for m in svc.models},
                          svc.runtime.eos_ids, [(ids, params)], make_policy("query-confidence", tokens=2), 1)
