"""Neural and probe routers: checkpoint round-trip, decisions, batched == one-at-a-time, errors."""
from __future__ import annotations

import pytest
import torch

from tokenrouter.policies import StepFeatures, make_policy, parse_policy
from tokenrouter.policies.checkpoint import load_router, round_to_saved_precision, save_router
from tokenrouter.policies.router_net import FEATURES, RouterNet
from tokenrouter.policies.thresholds import score_quantiles

from conftest import make_seq

HIDDEN, VOCAB, TOP_K = 8, 32, 4
EMBEDDING = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(7))


def embed(ids: torch.Tensor) -> torch.Tensor:
    return EMBEDDING[ids]


def make_router(tmp_path, kind: str, dim: int, threshold: float = 0.5):
    torch.manual_seed(0)
    sizes = {"hidden": HIDDEN, "token_embedding": HIDDEN, "topk_logprobs": TOP_K}
    net = RouterNet({k: sizes[k] for k in FEATURES[kind]}, dim, 2 if dim else 0)
    round_to_saved_precision(net)
    path = tmp_path / f"{kind}.pt"
    save_router(path, net, {"kind": kind, "threshold": threshold, "pair": {"small": "tiny"},
                            "score_quantiles": score_quantiles(torch.linspace(0, 1, 101))})
    return net, path


def features(n: int, seed: int = 1) -> StepFeatures:
    g = torch.Generator().manual_seed(seed)
    return StepFeatures(torch.randn(n, VOCAB, generator=g) * 3, torch.randn(n, HIDDEN, generator=g),
                        [make_seq([i + 1]) for i in range(n)], embed)


def test_checkpoint_round_trip_keeps_outputs_and_metadata(tmp_path):
    net, path = make_router(tmp_path, "neural", 16)
    loaded, meta = load_router(path, "neural")
    f = features(5)
    x = {"hidden": f.hidden, "token_embedding": embed(f.logits.argmax(-1)),
         "topk_logprobs": torch.log_softmax(f.logits, -1).topk(TOP_K).values}
    torch.testing.assert_close(loaded(x), net(x).detach())
    assert meta["kind"] == "neural" and meta["threshold"] == 0.5
    assert loaded.config() == net.config()
    with pytest.raises(ValueError, match="expected 'probe'"):
        load_router(path, "probe")


def test_neural_reads_hidden_state_sampled_token_embedding_and_top_k(tmp_path):
    net, path = make_router(tmp_path, "neural", 16)
    f = features(6)
    sampled = f.logits.argmax(-1)  # greedy rows: the token the small model would write
    expected = torch.sigmoid(net({"hidden": f.hidden, "token_embedding": embed(sampled),
                                  "topk_logprobs": torch.log_softmax(f.logits, -1).topk(TOP_K).values})).detach()
    policy = make_policy("neural", path=str(path), threshold=0.5)
    sends, scores = policy.route(f)
    torch.testing.assert_close(torch.tensor(scores), expected)
    assert sends == (expected > 0.5).tolist()
    # another sampled token changes the score: the embedding is read
    f.embed = lambda ids: embed((ids + 1) % VOCAB)
    assert not torch.allclose(policy.scores(f), expected)


@pytest.mark.parametrize("kind,dim", [("neural", 16), ("probe", 0), ("probe", 8)])
def test_batched_scores_equal_one_at_a_time(tmp_path, kind, dim):
    _, path = make_router(tmp_path, kind, dim)
    policy = parse_policy(f"{kind}:path={path}")
    f = features(7)
    single = torch.cat([policy.scores(StepFeatures(f.logits[i:i + 1], f.hidden[i:i + 1], f.seqs[i:i + 1], embed))
                        for i in range(7)])
    torch.testing.assert_close(policy.scores(f), single, atol=1e-6, rtol=1e-5)


def test_threshold_comes_from_the_checkpoint_or_the_share_or_the_caller(tmp_path):
    _, path = make_router(tmp_path, "probe", 0, threshold=0.42)
    assert make_policy("probe", path=str(path)).threshold == 0.42
    assert make_policy("probe", path=str(path), share=0.25).threshold == pytest.approx(0.75)
    assert make_policy("probe", path=str(path), threshold=0.9).threshold == 0.9
    with pytest.raises(ValueError, match="threshold, share"):
        make_policy("probe", path=str(path), threshold=0.9, share=0.2)


def test_errors_name_the_problem(tmp_path):
    _, path = make_router(tmp_path, "neural", 16)
    with pytest.raises(ValueError, match="path: .* not found"):
        make_policy("neural", path=str(tmp_path / "missing.pt"))
    policy = make_policy("neural", path=str(path))
    wrong = StepFeatures(torch.randn(2, VOCAB), torch.randn(2, HIDDEN + 1), [make_seq([1]), make_seq([2])], embed)
    with pytest.raises(ValueError, match="hidden size"):
        policy.scores(wrong)
    no_embed = features(2)
    no_embed.embed = None
    with pytest.raises(ValueError, match="embedding"):
        policy.scores(no_embed)
