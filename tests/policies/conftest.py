from __future__ import annotations

import torch

from tokenrouter.engine.sequence import SamplingParams, Sequence
from tokenrouter.policies import make_policy


def make_seq(prompt: list[int], outputs: int = 0) -> Sequence:
    seq = Sequence(list(prompt), SamplingParams(), make_policy("all-small"), "small")
    seq.token_ids.extend(range(outputs))
    return seq


def peaked(vocab: int, top: int, margin: float) -> torch.Tensor:
    logits = torch.zeros(vocab)
    logits[top] = margin
    return logits
