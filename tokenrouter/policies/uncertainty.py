"""Training-free token-level policies read from the small model's logits: entropy and LogU."""
from __future__ import annotations

import torch

from tokenrouter.policies.base import Policy, StepFeatures, check_threshold

LOGU_KINDS = ("epistemic", "aleatoric", "product")


class Entropy(Policy):
    """Hands the token to the large model when the entropy (nats) of the small model's next-token
    distribution exceeds `threshold`."""
    name = "entropy"
    main_param = "threshold"

    def __init__(self, threshold: float = 1.0):
        self.threshold = check_threshold(threshold)

    def scores(self, f: StepFeatures) -> torch.Tensor:
        return entropy(f.logits)

    def describe(self) -> str:
        return f"entropy:threshold={self.threshold:g}"


class LogU(Policy):
    """LogU (Ma et al. 2025): the top-k logits are evidence of a Dirichlet over those k tokens,
    alpha_i = max(logit_i, 0). Epistemic uncertainty k / sum(alpha_i + 1) is high when there is little
    evidence at all; aleatoric uncertainty is the expected entropy of the Dirichlet, high when the
    evidence is spread over several tokens. `kind` picks the score: one of them or their product."""
    name = "logu"
    main_param = "threshold"

    def __init__(self, threshold: float = 0.5, k: int = 10, kind: str = "epistemic"):
        if not isinstance(k, int) or k < 2:
            raise ValueError(f"k: must be an integer >= 2, got {k!r}")
        if kind not in LOGU_KINDS:
            raise ValueError(f"kind: must be one of {LOGU_KINDS}, got {kind!r}")
        self.threshold, self.k, self.kind = check_threshold(threshold), k, kind

    def scores(self, f: StepFeatures) -> torch.Tensor:
        aleatoric, epistemic = logu(f.logits, self.k)
        return {"epistemic": epistemic, "aleatoric": aleatoric, "product": aleatoric * epistemic}[self.kind]

    def describe(self) -> str:
        return f"logu:threshold={self.threshold:g},k={self.k},kind={self.kind}"


def entropy(logits: torch.Tensor) -> torch.Tensor:
    # logits: [B, vocab] -> [B]
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


def logu(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # logits: [B, vocab] -> aleatoric [B], epistemic [B]
    alpha = logits.float().topk(min(k, logits.shape[-1]), -1).values.clamp_min(0)  # [B, k]
    alpha0 = alpha.sum(-1, keepdim=True)
    epistemic = alpha.shape[-1] / (alpha + 1).sum(-1)
    share = alpha / alpha0.clamp_min(1e-12)
    aleatoric = -(share * (torch.digamma(alpha + 1) - torch.digamma(alpha0 + 1))).sum(-1)
    return aleatoric, epistemic
