"""Policies that need no training: fixed choices, a seeded random share, a fixed schedule, confidence."""
from __future__ import annotations

import weakref

import torch

from tokenrouter.policies.base import Policy, StepFeatures


class AllSmall(Policy):
    name = "all-small"

    def scores(self, f: StepFeatures) -> torch.Tensor:
        return torch.zeros(len(f.seqs))


class AllLarge(AllSmall):
    """Every token from the large model: the large model is the home and never hands off."""
    name = "all-large"

    def home(self, models: list[str], prompt_ids: list[int] | None = None) -> str:
        return models[-1]


class RandomShare(Policy):
    """Each position goes to the large model with probability `share`, decided by a hash of
    (seed, prompt, position), so the decision does not depend on batching or timing."""
    name = "random"
    main_param = "share"

    def __init__(self, share: float = 0.15, seed: int = 0):
        if not 0 <= share <= 1:
            raise ValueError(f"share: must be in [0, 1], got {share!r}")
        self.share, self.seed = share, seed
        self.threshold = 1 - share

    def scores(self, f: StepFeatures) -> torch.Tensor:
        return torch.tensor([uniform(self.seed, prompt_key(s), len(s.token_ids)) for s in f.seqs])

    def threshold_params(self, score_threshold: float) -> dict:
        return {"share": 1 - score_threshold}

    def describe(self) -> str:
        return f"random:share={self.share}"


class Schedule(Policy):
    """Every `every`-th output token goes to the large model (a deterministic test policy)."""
    name = "schedule"
    main_param = "every"

    def __init__(self, every: int = 4):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every: must be an integer >= 1, got {every!r}")
        self.every = every

    def scores(self, f: StepFeatures) -> torch.Tensor:
        return torch.tensor([float(s.num_output_tokens % self.every == self.every - 1) for s in f.seqs])

    def describe(self) -> str:
        return f"schedule:every={self.every}"


class Confidence(Policy):
    """Hands the token to the large model when the small model's top-1 probability is below `threshold`.
    The score is 1 - top-1 probability."""
    name = "confidence"
    main_param = "threshold"

    def __init__(self, threshold: float = 0.9):
        if not 0 <= threshold <= 1:
            raise ValueError(f"threshold: must be in [0, 1], got {threshold!r}")
        self.top1_threshold = threshold
        self.threshold = 1 - threshold

    def scores(self, f: StepFeatures) -> torch.Tensor:
        return 1 - torch.softmax(f.logits, -1).max(-1).values

    def threshold_params(self, score_threshold: float) -> dict:
        return {"threshold": 1 - score_threshold}

    def describe(self) -> str:
        return f"confidence:threshold={self.top1_threshold}"


def uniform(seed: int, prompt: list[int] | int, position: int) -> float:
    """A number in [0, 1) fixed by the seed, the prompt (its ids, or `prompt_key` of them) and the position."""
    key = prompt if isinstance(prompt, int) else hash(tuple(prompt))
    return (hash((seed, key, position)) & 0xFFFF_FFFF) / 2**32


_prompt_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prompt_key(seq) -> int:
    """The hash of a sequence's prompt, taken once per sequence. NOTE: a policy scores every row of every step; hashing
    a prompt of thousands of tokens each time cost the host O(prompt) per row per step."""
    try:
        return _prompt_keys[seq]
    except KeyError:
        key = _prompt_keys[seq] = hash(tuple(seq.prompt_ids))
        return key
    except TypeError:  # not weakly referenceable: hashed each time
        return hash(tuple(seq.prompt_ids))
