"""The policy interface: after a step at a sequence's home model, decide who writes each next token."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StepFeatures:
    """What a policy may read for a batch of sequences, all from the home model's step."""
    logits: torch.Tensor  # [B, vocab] float32, next-token logits
    hidden: torch.Tensor  # [B, hidden] final-norm hidden state at the last position
    seqs: list  # list[Sequence], row by row


class Policy:
    """Scores a whole batch; a row whose score exceeds `threshold` goes to the target model."""
    name = ""
    threshold = 0.5

    def home(self, models: list[str]) -> str:
        return models[0]

    def target(self, models: list[str]) -> str:
        return models[-1]

    def scores(self, f: StepFeatures) -> torch.Tensor:  # [B]
        raise NotImplementedError

    def route(self, f: StepFeatures) -> tuple[list[bool], list[float]]:
        s = self.scores(f).float()
        return (s > self.threshold).tolist(), s.tolist()

    def describe(self) -> str:
        return self.name
