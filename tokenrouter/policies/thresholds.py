"""Thresholds from scores: to a target large-model share, to a target recall of divergent positions, or
from a checkpoint's held-out score quantiles. A position goes to the large model when score > threshold."""
from __future__ import annotations

import torch

QUANTILE_POINTS = 201


def check_share(share, name: str = "share") -> float:
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise ValueError(f"{name}: must be in [0, 1], got {share!r}")
    return float(share)


def threshold_for_share(scores: torch.Tensor, share: float) -> float:
    """The threshold above which a `share` of these scores lie."""
    share = check_share(share)
    s = scores.double().flatten().sort(descending=True).values
    if len(s) == 0:
        raise ValueError("scores: need at least one score to calibrate")
    n = round(share * len(s))
    if n == 0:
        return float(s[0])
    if n >= len(s):
        return float(s[-1]) - 1e-9
    return float((s[n - 1] + s[n]) / 2) if s[n - 1] > s[n] else float(s[n])


def threshold_for_recall(scores: torch.Tensor, labels: torch.Tensor, recall: float) -> float:
    """The highest threshold that still sends at least `recall` of the positive positions."""
    recall = check_share(recall, "recall")
    positive = scores.float().flatten()[labels.flatten().bool()].sort(descending=True).values
    if len(positive) == 0:
        raise ValueError("labels: no positive positions to calibrate a recall on")
    n = max(1, -(-round(recall * len(positive) * 1e6) // 1_000_000))  # ceil, robust to float noise
    lowest_sent = positive[min(n, len(positive)) - 1]
    # NOTE: the next float32 below it, so that `score > threshold` holds for that score in float32 too
    return float(torch.nextafter(lowest_sent, torch.tensor(-torch.inf)))


def score_quantiles(scores: torch.Tensor) -> list[float]:
    q = torch.linspace(0, 1, QUANTILE_POINTS, dtype=torch.float64)
    return torch.quantile(scores.double().flatten(), q).tolist()


def threshold_from_quantiles(quantiles: list[float], share: float) -> float:
    """The threshold that sent `share` of the held-out positions a checkpoint was calibrated on."""
    share = check_share(share)
    q = torch.tensor(quantiles, dtype=torch.float64)
    position = (1 - share) * (len(q) - 1)
    low = int(position)
    high = min(low + 1, len(q) - 1)
    return float(q[low] + (q[high] - q[low]) * (position - low))


def share_above(scores: torch.Tensor, threshold: float) -> float:
    return float((scores.double() > threshold).double().mean())
