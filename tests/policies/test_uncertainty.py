"""Entropy and LogU decisions on constructed logits."""
from __future__ import annotations

import math

import pytest
import torch

from tokenrouter.policies import StepFeatures, make_policy, parse_policy
from tokenrouter.policies.uncertainty import logu

from conftest import make_seq, peaked


def features(logits: torch.Tensor) -> StepFeatures:
    return StepFeatures(logits, torch.zeros(len(logits), 4), [make_seq([1, 2]) for _ in logits])


def test_entropy_sends_flat_distributions_and_keeps_peaked_ones():
    logits = torch.stack([torch.zeros(8), peaked(8, 3, 20.0)])
    sends, scores = make_policy("entropy", threshold=1.0).route(features(logits))
    assert scores[0] == pytest.approx(math.log(8), abs=1e-5)
    assert scores[1] < 1e-5
    assert sends == [True, False]


def test_logu_epistemic_is_high_without_evidence_and_low_with_much():
    no_evidence = torch.full((16,), -1.0)  # every logit clamps to alpha 0: k / k = 1
    strong = peaked(16, 0, 50.0)
    aleatoric, epistemic = logu(torch.stack([no_evidence, strong]), k=4)
    assert epistemic.tolist() == pytest.approx([1.0, 4 / 54], abs=1e-6)
    sends, _ = make_policy("logu", threshold=0.5, k=4).route(features(torch.stack([no_evidence, strong])))
    assert sends == [True, False]


def test_logu_aleatoric_is_higher_when_evidence_is_spread():
    spread = torch.tensor([10.0, 10.0, 10.0, 10.0, 0, 0])
    single = torch.tensor([40.0, 0, 0, 0, 0, 0])
    aleatoric, _ = logu(torch.stack([spread, single]), k=4)
    assert aleatoric[0] > 1.0 > aleatoric[1]
    policy = parse_policy("logu:kind=aleatoric,threshold=1.0,k=4")
    assert policy.route(features(torch.stack([spread, single])))[0] == [True, False]


def test_bad_parameters_name_the_field():
    with pytest.raises(ValueError, match="kind"):
        make_policy("logu", kind="total")
    with pytest.raises(ValueError, match="threshold"):
        make_policy("entropy", threshold=-1)
    with pytest.raises(ValueError, match="k:"):
        make_policy("logu", k=1)


@pytest.mark.parametrize("spec", ["entropy", "logu", "logu:kind=product", "confidence"])
def test_batched_scores_equal_one_at_a_time(spec):
    torch.manual_seed(0)
    logits = torch.randn(9, 50) * 4
    policy = parse_policy(spec)
    batched = policy.scores(features(logits))
    single = torch.cat([policy.scores(features(logits[i:i + 1])) for i in range(9)])
    torch.testing.assert_close(batched, single)


def test_every_policy_declares_its_level():
    from tokenrouter.policies import POLICIES

    assert {p.level for p in POLICIES.values()} == {"token", "query"}
    assert POLICIES["entropy"].level == "token" and POLICIES["query-random"].level == "query"
