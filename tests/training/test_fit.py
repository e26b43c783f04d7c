"""Operating points of router scores: each point matches `metrics` at that threshold, and the ROC curve's
area is the AUC."""
from __future__ import annotations

import pytest
import torch

from tokenrouter.training.fit import auc, metrics, operating_points


def test_each_point_is_the_metrics_of_sending_the_scores_above_it():
    scores = torch.tensor([0.9, 0.8, 0.8, 0.5, 0.3, 0.3, 0.1])
    labels = torch.tensor([1, 0, 1, 1, 0, 0, 0])
    points = operating_points(scores, labels)
    assert points["share"][0] == 0 and points["precision"][0] == 1 and points["recall"][0] == 0
    # one point per distinct score: ties are sent together
    assert len(points["share"]) == 1 + len(scores.unique())
    for i, lowest_sent in enumerate(scores.unique().sort(descending=True).values, 1):
        expected = metrics(scores, labels, float(lowest_sent) - 1e-6)
        assert points["share"][i] == pytest.approx(expected["share"])
        assert points["precision"][i] == pytest.approx(expected["precision"])
        assert points["recall"][i] == pytest.approx(expected["recall"])
    assert points["recall"][-1] == 1 and points["fpr"][-1] == 1


def test_area_under_the_roc_points_is_the_auc():
    generator = torch.Generator().manual_seed(0)
    labels = torch.rand(400, generator=generator) < 0.2
    scores = torch.rand(400, generator=generator) + 0.5 * labels
    points = operating_points(scores, labels)
    assert float(torch.trapezoid(points["recall"], points["fpr"])) == pytest.approx(auc(scores, labels.float()))


def test_training_shows_its_epochs_and_validation_loss_on_stderr(capsys):
    from tokenrouter.training.fit import fit
    from tokenrouter.policies.router_net import RouterNet

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=generator)
    y = (x[:, 0] > 0).float()
    history = fit(RouterNet({"hidden": 4}, 0, 0), ({"hidden": x}, y), ({"hidden": x}, y), epochs=3, desc="probe")
    err = capsys.readouterr().err
    assert history["epochs"] == 3 and "probe" in err and "3/3" in err and "valid_loss=" in err
