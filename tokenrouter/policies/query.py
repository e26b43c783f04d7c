"""Query-level routers: one model writes the whole response. The decision is taken once, from the prompt
(or, for `query-confidence:tokens=k`, from the small model's first k tokens, which a send then drops), and
every later position of the sequence carries that same score, so the engine (where a send moves the home
for good) and the per-request baseline (which asks per token) write the same tokens."""
from __future__ import annotations

import math

import torch

from tokenrouter.policies.base import Policy, StepFeatures, check_threshold
from tokenrouter.policies.simple import uniform
from tokenrouter.policies.state import PerSequence
from tokenrouter.policies.thresholds import check_share
from tokenrouter.policies.trained import TrainedScorer

MAX_PROBE_TOKENS = 256


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
    main_param = "share"

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
    """The small model's confidence, read after the prompt's prefill (the top-1 probability of the first
    answer token) or, with `tokens=k`, over the first k tokens it writes (their mean top-1 probability).
    Below `threshold`, the whole response goes to the large model; with k > 0 those k tokens are held
    back from the reader until the decision and dropped on a send (the large model starts the response
    afresh), and a response the small model ends within k tokens stays with it. The score is 1 - the
    confidence."""
    name = "query-confidence"
    main_param = "threshold"

    def __init__(self, threshold: float = 0.5, tokens: int = 0):
        super().__init__()
        self.top1_threshold = check_threshold(threshold, 0, 1)
        self.threshold = 1 - self.top1_threshold
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_PROBE_TOKENS:
            raise ValueError(f"tokens: must be an integer in [0, {MAX_PROBE_TOKENS}], got {tokens!r}")
        self.decides_after = tokens
        self.top1 = PerSequence()  # output position -> the small model's top-1 probability there

    def scores(self, f: StepFeatures) -> torch.Tensor:
        if not self.decides_after:
            return super().scores(f)
        self.decided.sweep()
        self.top1.sweep()
        top1 = torch.softmax(f.logits.float(), -1).max(-1).values.tolist()
        out = []
        for seq, p in zip(f.seqs, top1):
            score = self.decided.get(seq)
            if score is None:
                seen = self.top1.get(seq) or {}
                if seq.num_output_tokens < self.decides_after:
                    # NOTE: keyed by position, so a step repeated after a preemption is counted once
                    seen[seq.num_output_tokens] = p
                    self.top1.set(seq, seen)
                    score = math.nan  # not decided yet: the small model keeps the token
                else:
                    score = 1 - sum(seen.values()) / len(seen)
                    self.decided.set(seq, score)
            out.append(score)
        return torch.tensor(out)

    def prompt_scores(self, f: StepFeatures) -> torch.Tensor:
        return 1 - torch.softmax(f.logits.float(), -1).max(-1).values

    def threshold_params(self, score_threshold: float) -> dict:
        return {"threshold": 1 - score_threshold}

    def describe(self) -> str:
        tokens = f",tokens={self.decides_after}" if self.decides_after else ""
        return f"query-confidence:threshold={self.top1_threshold:.4g}{tokens}"


class QueryClassifier(QueryPolicy):
    """A classifier on the small model's hidden state at the end of the prompt, trained on task outcomes
    (by default: the large model passes a task the small one fails; `tokenrouter.training.outcomes`): its
    probability that the large model is worth it. Loads a `query` checkpoint like the token-level routers
    (`path=`, `threshold=`, `share=`)."""
    name = "query-classifier"
    main_param = "threshold"

    def __init__(self, path: str = "", threshold: float | None = None, share: float | None = None):
        super().__init__()
        self.router = TrainedScorer("query", path, threshold, share)
        self.threshold = self.router.threshold

    def prompt_scores(self, f: StepFeatures) -> torch.Tensor:
        return self.router.probabilities(f)

    def describe(self) -> str:
        return f"query-classifier:path={self.router.path},threshold={self.threshold:.4g}"
