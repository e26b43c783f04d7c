"""Trained token-level routers: `neural` (R2R-style) and `probe` (CITER / Co-LLM-style hidden-state
deferral probe). Each loads a checkpoint (`neural:path=...`, default: the router shipped for the embedded
pair); the threshold is the checkpoint's calibrated one unless `threshold=` or `share=` is given."""
from __future__ import annotations

from pathlib import Path

import torch

from tokenrouter.policies.base import Policy, StepFeatures
from tokenrouter.policies.checkpoint import default_router_path, load_router
from tokenrouter.policies.router_net import topk_logprobs
from tokenrouter.policies.thresholds import threshold_from_quantiles


class TrainedScorer:
    """A loaded router: resolves its threshold and turns step features into probabilities."""

    def __init__(self, kind: str, path: str | Path = "", threshold: float | None = None, share: float | None = None):
        if threshold is not None and share is not None:
            raise ValueError("threshold, share: give one of them, not both")
        self.kind = kind
        self.path = str(path or default_router_path(kind))
        self.net, self.meta = load_router(self.path, kind)
        if threshold is not None:
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
                raise ValueError(f"threshold: must be a probability in [0, 1], got {threshold!r}")
            self.threshold = float(threshold)
        elif share is not None:
            self.threshold = threshold_from_quantiles(self.meta["score_quantiles"], share)
        else:
            self.threshold = float(self.meta["threshold"])

    def check_hidden_size(self, hidden_size: int) -> None:
        if hidden_size != self.net.inputs["hidden"]:
            raise ValueError(f"path: router {self.path!r} was trained on hidden size {self.net.inputs['hidden']} "
                             f"({self.meta.get('pair')}), this model has {hidden_size}")

    def probabilities(self, f: StepFeatures) -> torch.Tensor:  # [B]
        inputs = self.net.inputs
        self.check_hidden_size(f.hidden.shape[-1])
        features = {"hidden": f.hidden}
        if "topk_logprobs" in inputs:
            features["topk_logprobs"] = topk_logprobs(f.logits, inputs["topk_logprobs"])
        if "token_embedding" in inputs:
            if f.embed is None:
                raise ValueError(f"{self.kind}: needs the home model's token embedding (StepFeatures.embed)")
            features["token_embedding"] = f.embed(f.sampled().to(f.hidden.device))
        with torch.no_grad():
            return torch.sigmoid(self.net({k: v.cpu() for k, v in features.items()}))


class _TrainedPolicy(Policy):
    kind = ""
    main_param = "threshold"

    def __init__(self, path: str = "", threshold: float | None = None, share: float | None = None):
        self.router = TrainedScorer(self.kind, path, threshold, share)
        self.threshold = self.router.threshold

    def scores(self, f: StepFeatures) -> torch.Tensor:
        return self.router.probabilities(f)

    def describe(self) -> str:
        return f"{self.name}:path={self.router.path},threshold={self.threshold:.4g}"


class Neural(_TrainedPolicy):
    """R2R: hidden state + sampled token's embedding + top-k log-probs -> residual MLP -> probability."""
    name = kind = "neural"


class Probe(_TrainedPolicy):
    """CITER / Co-LLM: a linear or small-MLP probe on the hidden state -> deferral probability."""
    name = kind = "probe"
