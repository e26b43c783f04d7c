"""Fitting a router network to labelled examples (class-weighted), and its held-out metrics."""
from __future__ import annotations

import copy

import torch
from torch import nn

from tokenrouter.bench import progress
from tokenrouter.policies.router_net import RouterNet
from tokenrouter.policies.thresholds import share_above


def fit(net: RouterNet, train: tuple[dict, torch.Tensor], valid: tuple[dict, torch.Tensor], epochs: int = 30,
        lr: float = 1e-3, weight_decay: float = 1e-2, batch: int = 256, seed: int = 0, desc: str = "training") -> dict:
    """Trains `net` in place with positives weighted by negatives / positives; keeps the epoch with the
    lowest weighted loss on `valid` (a bar on stderr shows the epochs and that loss). Returns the training
    history."""
    features, labels = train
    net.standardise_from(features)
    positives = float(labels.sum())
    if positives == 0 or positives == len(labels):
        raise ValueError(f"labels: the training split has {int(positives)} positives of {len(labels)}; "
                         "training needs both classes (more prompts, or another divergence criterion)")
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor((len(labels) - positives) / positives))
    optimiser = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    best, best_loss, history = copy.deepcopy(net.state_dict()), float("inf"), []
    bar = progress.bar(epochs, desc, unit="epoch")
    for epoch in range(epochs):
        net.train()
        order = torch.randperm(len(labels), generator=generator)
        for start in range(0, len(labels), batch):
            rows = order[start:start + batch]
            optimiser.zero_grad()
            loss = loss_fn(net({k: v[rows] for k, v in features.items()}), labels[rows])
            loss.backward()
            optimiser.step()
        net.eval()
        with torch.no_grad():
            valid_loss = float(loss_fn(net(valid[0]), valid[1]))
        history.append(valid_loss)
        if valid_loss < best_loss:
            best, best_loss = copy.deepcopy(net.state_dict()), valid_loss
        bar.set_postfix(valid_loss=f"{valid_loss:.4f}", best=f"{best_loss:.4f}", refresh=False)
        bar.update()
    bar.close()
    net.load_state_dict(best)
    return {"epochs": epochs, "best_epoch": history.index(best_loss) + 1, "valid_loss": best_loss}


def probabilities(net: RouterNet, features: dict[str, torch.Tensor]) -> torch.Tensor:
    net.eval()
    with torch.no_grad():
        return torch.sigmoid(net(features))


def metrics(scores: torch.Tensor, labels: torch.Tensor, threshold: float) -> dict:
    """Precision and recall of divergent positions among those sent (score > threshold), the share sent,
    and the ROC AUC of the scores."""
    sent = scores > threshold
    positive = labels.bool()
    true_sent = int((sent & positive).sum())
    return {"share": share_above(scores, threshold), "precision": true_sent / max(1, int(sent.sum())),
            "recall": true_sent / max(1, int(positive.sum())), "auc": auc(scores, labels),
            "positives": int(positive.sum()), "examples": len(labels)}


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    positive = labels.bool()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = torch.empty(len(scores), dtype=torch.float64)
    ranks[scores.double().argsort()] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def operating_points(scores: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every distinct threshold from the highest score down (first point: nothing sent, precision 1): the
    share sent, precision, recall and false-positive rate, for ROC and precision-recall curves."""
    order = scores.double().flatten().argsort(descending=True)
    s, y = scores.double().flatten()[order], labels.flatten().bool()[order]
    last = torch.cat([s[1:] != s[:-1], torch.tensor([True])])  # the last row of each run of equal scores
    zero = torch.zeros(1, dtype=torch.float64)
    true_sent = torch.cat([zero, y.double().cumsum(0)[last]])
    sent = torch.cat([zero, torch.arange(1, len(s) + 1, dtype=torch.float64)[last]])
    positives, negatives = max(1, int(y.sum())), max(1, int((~y).sum()))
    return {"share": sent / max(1, len(s)), "precision": torch.where(sent > 0, true_sent / sent.clamp_min(1), 1.0),
            "recall": true_sent / positives, "fpr": (sent - true_sent) / negatives}
