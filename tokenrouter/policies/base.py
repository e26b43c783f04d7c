"""The policy interface: after a step at a sequence's home model, decide who writes each next token."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenrouter.engine.sampler import sample


@dataclass(slots=True)
class StepFeatures:
    """What a policy may read for a batch of sequences, all from the home model's step.
    NOTE: read-only: where a policy reads every row of a step, `logits` and `hidden` are the step's own tensors,
    which the sampler reads after the policy (an in-place change would change the tokens)."""
    logits: torch.Tensor  # [B, vocab] float32, next-token logits
    hidden: torch.Tensor  # [B, hidden] final-norm hidden state at the last position
    seqs: list  # list[Sequence], row by row
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None  # token ids [B] -> home model's embeddings [B, hidden]

    def sampled(self) -> torch.Tensor:  # [B] long
        """The token the home model writes at each row if it keeps the position (same draw as the engine's)."""
        return torch.tensor(sample(self.logits, [s.params for s in self.seqs], [len(s.token_ids) for s in self.seqs]),
                            dtype=torch.long)


class Policy:
    """Scores a whole batch; a row whose score exceeds `threshold` goes to the target model.
    `level` is "token" (decided per token) or "query" (one model writes the whole response)."""
    name = ""
    level = "token"
    threshold = 0.5
    # NOTE: when True, a send moves the sequence's home to the target for good: the target then writes
    # every later token and the sequence never returns (query-level routing).
    moves_home = False
    # NOTE: output tokens a query-level policy reads before it decides (0: it decides on the prompt). Until
    # then the engine holds the home's tokens back from the reader; a send restarts the response at the
    # target, dropping them, so one model writes the whole response.
    decides_after = 0
    # NOTE: a verifying policy's home writes drafts that its target judges (engine/verification.py); at most
    # `draft_limit` wait before the sequence goes to the target (0: no limit but the policy's own sends)
    verifies = False
    draft_limit = 0
    tolerance: float | None = None  # verifying policies: keep drafts this likely relative to the verifier's own
    main_param: str | None = None  # the parameter a bare value in a spec sets: "confidence:0.9"
    spec: tuple[str, dict] | None = None  # (name, parameters) when built by make_policy

    def home(self, models: list[str], prompt_ids: list[int] | None = None) -> str:
        return models[0]

    def target(self, models: list[str]) -> str:
        return models[-1]

    def scores(self, f: StepFeatures) -> torch.Tensor:  # [B]
        raise NotImplementedError

    def route(self, f: StepFeatures) -> tuple[list[bool], list[float]]:
        s = self.scores(f).float()
        return self.sends(s).tolist(), s.tolist()

    def sends(self, scores: torch.Tensor) -> torch.Tensor:  # [B] float32 -> [B] bool
        """Which rows go to the target model. NOTE: the worker calls this on the device and reads the result back
        with the step's other values in one copy, so a policy decides through scores() and this, not route()."""
        return scores > self.threshold

    def check_hidden_size(self, hidden_size: int) -> None:
        """Raise ValueError if this policy cannot read a home model of this hidden size (a trained router's
        input width), so a request is refused before a step would fail on it."""
        router = getattr(self, "router", None)
        if router is not None:
            router.check_hidden_size(hidden_size)

    def threshold_params(self, score_threshold: float) -> dict:
        """The constructor parameters that make this policy send exactly the scores above `score_threshold`."""
        return {"threshold": score_threshold}

    def describe(self) -> str:
        return self.name


def check_threshold(value, low: float = 0.0, high: float = float("inf"), name: str = "threshold") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{name}: must be a number in [{low}, {high}], got {value!r}")
    return float(value)
