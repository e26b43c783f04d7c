"""Smoothing wrappers around any token-level scorer: a rolling mean or momentum of its scores along each
sequence (`rolling:of=entropy,window=4`); parameters other than the wrapper's own go to the inner policy, and a
wrapped wrapper goes in parentheses (`rolling:of=(momentum:of=entropy,beta=0.5),window=4`)."""
from __future__ import annotations

from collections import deque

import torch

from tokenrouter.policies.base import Policy, StepFeatures
from tokenrouter.policies.state import PerSequence


class Smoothed(Policy):
    main_param = "of"

    def __init__(self, of: str, threshold: float | None = None, **inner_params):
        from tokenrouter.policies import make_policy, split_wrapped

        if not isinstance(of, str) or not of:
            raise ValueError(f"of: the inner policy's name is required, got {of!r}")
        inner, params = split_wrapped(of, inner_params)
        self.inner = make_policy(inner, **params)
        if self.inner.level != "token":
            raise ValueError(f"of: {of!r} is a {self.inner.level}-level policy; smoothing wraps token-level ones")
        if self.inner.verifies:
            raise ValueError(f"of: {of!r} verifies, and only the outermost policy can: wrap the other way round, "
                             f"verify:of=({self.name}:of=entropy)")
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))):
            raise ValueError(f"threshold: must be a number, got {threshold!r}")
        self.threshold = self.inner.threshold if threshold is None else float(threshold)
        self.state = PerSequence()

    def home(self, models: list[str], prompt_ids: list[int] | None = None) -> str:
        return self.inner.home(models, prompt_ids)

    def check_hidden_size(self, hidden_size: int) -> None:
        self.inner.check_hidden_size(hidden_size)

    def target(self, models: list[str]) -> str:
        return self.inner.target(models)

    def inner_spec(self) -> str:
        """The inner policy as `of=` names it: a wrapper in parentheses, with its parameters."""
        return f"({self.inner.describe()})" if getattr(self.inner, "inner", None) is not None else self.inner.name

    def scores(self, f: StepFeatures) -> torch.Tensor:
        raw = self.inner.scores(f).float().tolist()
        self.state.sweep()
        return torch.tensor([self.update(seq, len(seq.token_ids), x) for seq, x in zip(f.seqs, raw)])

    def update(self, seq, position: int, score: float) -> float:
        raise NotImplementedError


class Rolling(Smoothed):
    """The mean of the inner scores over the last `window` positions of the sequence."""
    name = "rolling"

    def __init__(self, of: str, window: int = 4, threshold: float | None = None, **inner_params):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window: must be an integer >= 1, got {window!r}")
        self.window = window
        super().__init__(of, threshold, **inner_params)

    def update(self, seq, position: int, score: float) -> float:
        recent = self.state.get(seq)
        if recent is None:
            recent = deque(maxlen=self.window)
            self.state.set(seq, recent)
        if recent and recent[-1][0] == position:  # the same position scored again replaces its score
            recent.pop()
        recent.append((position, score))
        return sum(s for _, s in recent) / len(recent)

    def describe(self) -> str:
        return f"rolling:of={self.inner_spec()},window={self.window},threshold={self.threshold:g}"


class Momentum(Smoothed):
    """An exponential moving average of the inner scores: m = beta * m_prev + (1 - beta) * score, starting
    at the first score."""
    name = "momentum"

    def __init__(self, of: str, beta: float = 0.7, threshold: float | None = None, **inner_params):
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
            raise ValueError(f"beta: must be in [0, 1), got {beta!r}")
        self.beta = float(beta)
        super().__init__(of, threshold, **inner_params)

    def update(self, seq, position: int, score: float) -> float:
        last = self.state.get(seq)  # (position, value before it, value after it)
        before = None if last is None else (last[1] if last[0] == position else last[2])
        value = score if before is None else self.beta * before + (1 - self.beta) * score
        self.state.set(seq, (position, before, value))
        return value

    def describe(self) -> str:
        return f"momentum:of={self.inner_spec()},beta={self.beta:g},threshold={self.threshold:g}"
