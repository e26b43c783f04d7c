"""Calibration to a target share or recall, checked on held-out scores."""
from __future__ import annotations

import pytest
import torch

from tokenrouter.training.fit import auc, metrics
from tokenrouter.policies.thresholds import (score_quantiles, share_above, threshold_for_recall, threshold_for_share,
                                             threshold_from_quantiles)


def scores_and_labels(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    labels = torch.rand(n, generator=g) < 0.2
    scores = torch.randn(n, generator=g) + 1.5 * labels  # positives score higher
    return scores, labels.float()


@pytest.mark.parametrize("share", [0.05, 0.15, 0.5])
def test_share_calibrated_on_one_half_holds_on_the_other(share):
    calibrate, _ = scores_and_labels(5000, 0)
    held_out, _ = scores_and_labels(5000, 1)
    threshold = threshold_for_share(calibrate, share)
    assert share_above(calibrate, threshold) == pytest.approx(share, abs=1e-3)
    assert share_above(held_out, threshold) == pytest.approx(share, abs=0.02)


def test_quantiles_stored_in_a_checkpoint_reproduce_the_share():
    calibrate, _ = scores_and_labels(5000, 2)
    held_out, _ = scores_and_labels(5000, 3)
    quantiles = score_quantiles(calibrate)
    for share in (0.1, 0.3):
        assert share_above(held_out, threshold_from_quantiles(quantiles, share)) == pytest.approx(share, abs=0.02)


def test_recall_target_sends_at_least_that_share_of_positives():
    scores, labels = scores_and_labels(4000, 4)
    for recall in (0.5, 0.8, 1.0):
        threshold = threshold_for_recall(scores, labels, recall)
        got = metrics(scores, labels, threshold)["recall"]
        assert recall <= got < recall + 1e-3 + 1 / labels.sum().item()
    held_out, held_labels = scores_and_labels(4000, 5)
    threshold = threshold_for_recall(scores, labels, 0.8)
    assert metrics(held_out, held_labels, threshold)["recall"] == pytest.approx(0.8, abs=0.04)


def test_edges_and_errors():
    s = torch.tensor([0.1, 0.2, 0.3, 0.4])
    assert share_above(s, threshold_for_share(s, 0.0)) == 0.0
    assert share_above(s, threshold_for_share(s, 1.0)) == 1.0
    assert share_above(s, threshold_for_share(s, 0.5)) == 0.5
    with pytest.raises(ValueError, match="share"):
        threshold_for_share(s, 1.5)
    with pytest.raises(ValueError, match="labels"):
        threshold_for_recall(s, torch.zeros(4), 0.5)


def test_auc_of_perfect_and_reversed_scores():
    labels = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), labels) == 1.0
    assert auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), labels) == 0.0
