"""Query-level routers: one model writes the whole response. The decision is taken once, from the prompt,
and every position of the sequence then carries that same score, so the engine (where a send moves the
home for good) and the baselines (which ask per token) write the same tokens."""
from __future__ import annotations

import torch

from tokenrouter.policies.base import Policy, StepFeatures, check_threshold
from tokenrouter.policies.simple import uniform
from tokenrouter.policies.state import PerSequence
from tokenrouter.policies.thresholds import check_share
from tokenrouter.policies.trained import TrainedScorer


class QueryPolicy(Policy):
    level = "query"
    moves_home = True

    def __init__(self):
        self.decided = PerSequence()

    def scores(self, f: StepFeatures) -> torch.Tensor:
        # NOTE: a sequence's first decision is taken at the small model right after its prompt's prefill;
        # later rows (at either model) reuse it and never recompute from another model's features.
        self.decided.sweep()
        fresh = [i for i, s in enumerate(f.seqs) if self.decided.get(s) is None]
        if fresh:
            sub = StepFeatures(f.logits[fresh], f.hidden[fresh], [f.seqs[i] for i in fresh], f.embed)
            for i, score in zip(fresh, self.prompt_scores(sub).float().tolist()):
                self.decided.set(f.seqs[i], score)
        return torch.tensor([self.decided.get(s) for s in f.seqs])

    def prompt_scores(self, f: StepFeatures) -> torch.Tensor:  # [B], from the features at the end of the prompt
        raise NotImplementedError


class QueryRandom(QueryPolicy):
    """A seeded hash of the prompt sends a `share` of the prompts to the large model, which is then the
    home from the start (the small model never runs for them)."""
    name = "query-random"

    def __init__(self, share: float = 0.15, seed: int = 0):
        super().__init__()
        self.share, self.seed = check_share(share), seed
        self.threshold = 1 - self.share

    def home(self, models: list[str], prompt_ids: list[int] | None = None) -> str:
        if prompt_ids is not None and uniform(self.seed, prompt_ids, -1) > self.threshold:
            return models[-1]
        return models[0]

    def scores(self, f: StepFeatures) -> torch.Tensor:
        return torch.tensor([uniform(self.seed, s.prompt_ids, -1) for s in f.seqs])

    def threshold_params(self, score_threshold: float) -> dict:
        return {"share": 1 - score_threshold}

    def describe(self) -> str:
        return f"query-random:share={self.share:g}"


class QueryConfidence(QueryPolicy):
    """The small model's top-1 probability for the first answer token, read after the prompt's prefill:
    below `threshold`, the whole response goes to the large model. The score is 1 - top-1 probability."""
    name = "query-confidence"

    def __init__(self, threshold: float = 0.5):
        super().__init__()
        self.top1_threshold = check_threshold(threshold, 0, 1)
        self.threshold = 1 - self.top1_threshold

    def prompt_scores(self, f: StepFeatures) -> torch.Tensor:
        return 1 - torch.softmax(f.logits.float(), -1).max(-1).values

    def threshold_params(self, score_threshold: float) -> dict:
        return {"threshold": 1 - score_threshold}

    def describe(self) -> str:
        return f"query-confidence:threshold={self.top1_threshold:.4g}"


class QueryClassifier(QueryPolicy):
    """A classifier on the small model's hidden state at the end of the prompt, trained on task outcomes
    (does the small model's own answer match the large model's?): its probability that the small model
    falls short. Loads a `query` checkpoint like the token-level routers (`path=`, `threshold=`, `share=`)."""
    name = "query-classifier"

    def __init__(self, path: str = "", threshold: float | None = None, share: float | None = None):
        super().__init__()
        self.router = TrainedScorer("query", path, threshold, share)
        self.threshold = self.router.threshold

    def prompt_scores(self, f: StepFeatures) -> torch.Tensor:
        return self.router.probabilities(f)

    def describe(self) -> str:
        return f"query-classifier:path={self.router.path},threshold={self.threshold:.4g}"
