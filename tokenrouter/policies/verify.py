"""Verifying policies: the home (small) model drafts, the target (large) model judges the drafts when the
sequence visits it, keeps the ones it would have written itself and replaces the first it would not
(tokenrouter/engine/verification.py).

- `verify:every=k` (`verify:4`; plain `verify` is k = 4): speculative decoding inside the engine. The small model drafts k tokens, the
  large model judges them in one step and writes the next: greedy or sampled, the output is all-large's.
- `verify:of=POLICY,...`: any token-level policy decides when the large model writes a token; before it does,
  it judges everything the small model wrote since its last visit. Parameters other than `of` and `hold` go to
  the wrapped policy. At most `hold` drafts wait (they are held from the reader until judged): after as many,
  the sequence visits the large model even if the wrapped policy did not send it. A wrapped wrapper goes in
  parentheses: `verify:of=(rolling:of=entropy,window=4),hold=16`.
- `tolerance=r` (either form, 0 < r <= 1): lossy verification, Big Little Decoder's rollback rule. A draft is also
  accepted where the large model finds it at least r times as likely as its own token, so fewer drafts are
  rolled back and redone; the output is then no longer exactly all-large's (tokenrouter/engine/verification.py).
"""
from __future__ import annotations

import torch

from tokenrouter.policies.base import Policy, StepFeatures

DEFAULT_EVERY = 4  # plain `verify`: the best k on the embedded pair (docs/policies.md)
DEFAULT_HOLD = 32


class Verify(Policy):
    name = "verify"
    verifies = True
    main_param = "every"

    def __init__(self, every: int | None = None, of: str | None = None, hold: int | None = None,
                 tolerance: float | None = None, **inner_params):
        from tokenrouter.policies import make_policy, split_wrapped

        if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                      or not 0 < tolerance <= 1):
            raise ValueError(f"tolerance: must be a number in (0, 1] (accept a draft the verifier finds at least "
                             f"that many times as likely as its own token), got {tolerance!r}")
        self.tolerance = None if tolerance is None else float(tolerance)

        if every is not None and of is not None:
            raise ValueError("verify: give every=K (draft K tokens, then verify) or of=POLICY (verify when a "
                             "token-level policy sends), not both")
        if every is None and of is None:
            every = DEFAULT_EVERY
        self.inner: Policy | None = None
        if every is not None:
            if isinstance(every, bool) or not isinstance(every, int) or every < 1:
                raise ValueError(f"every: must be an integer >= 1, got {every!r}")
            extra = sorted([*inner_params, *(["hold"] if hold is not None else [])])
            if extra:
                raise ValueError(f"verify:every takes no parameters but tolerance, got {extra}")
            self.every, self.draft_limit = every, every
            return
        if not isinstance(of, str) or not of:
            raise ValueError(f"of: the wrapped policy's name is required, got {of!r}")
        hold = DEFAULT_HOLD if hold is None else hold
        if isinstance(hold, bool) or not isinstance(hold, int) or hold < 1:
            raise ValueError(f"hold: must be an integer >= 1, got {hold!r}")
        inner, params = split_wrapped(of, inner_params)
        self.inner = make_policy(inner, **params)
        if self.inner.level != "token" or self.inner.moves_home or self.inner.decides_after:
            raise ValueError(f"of: {of!r} is a {self.inner.level}-level policy; verification wraps token-level ones")
        if self.inner.verifies:
            raise ValueError(f"of: {of!r} verifies already")
        self.every, self.draft_limit = None, hold
        self.threshold = self.inner.threshold

    def home(self, models: list[str], prompt_ids: list[int] | None = None) -> str:
        return models[0] if self.inner is None else self.inner.home(models, prompt_ids)

    def target(self, models: list[str]) -> str:
        return models[-1] if self.inner is None else self.inner.target(models)

    def check_hidden_size(self, hidden_size: int) -> None:
        if self.inner is not None:
            self.inner.check_hidden_size(hidden_size)

    def scores(self, f: StepFeatures) -> torch.Tensor:
        if self.inner is None:  # the engine sends after every k drafts; no score to read
            return torch.full((len(f.seqs),), float("nan"))
        return self.inner.scores(f)

    def threshold_params(self, score_threshold: float) -> dict:
        if self.inner is None:
            raise ValueError("verify:every has no threshold")
        return self.inner.threshold_params(score_threshold)

    def describe(self) -> str:
        tolerance = "" if self.tolerance is None else f",tolerance={self.tolerance:g}"
        if self.inner is None:
            return f"verify:every={self.every}{tolerance}"
        inner = self.inner.describe()
        if getattr(self.inner, "inner", None) is not None:  # a wrapper: its own `of` would repeat the key
            return f"verify:of=({inner}),hold={self.draft_limit}{tolerance}"
        name, _, params = inner.partition(":")
        return f"verify:of={name}{',' + params if params else ''},hold={self.draft_limit}{tolerance}"
