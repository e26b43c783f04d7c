"""Token sampling: greedy, or temperature / top-k / top-p with a per-request, per-position seed.

Seeding each draw by (seed, position) makes a sampled token independent of batching and of which
model produced the earlier tokens, so the engine and the baselines draw the same token.

NOTE: a draw is an exponential race, argmax(p / E) with E ~ Exp(1) per vocabulary entry, which picks
entry i with probability p_i. The noise E depends only on (seed, position) and comes from a CPU generator,
so two models drawing the same position of the same request share it: they draw the same token wherever
their distributions agree, and a model's draw does not depend on its device. Verification rests on this
(tokenrouter/engine/verification.py): the large model's draw at a drafted position is what it would have
written there, so accepting the draft exactly when the two agree gives the large model's output.
"""
from __future__ import annotations

import torch

from tokenrouter.engine.sequence import SamplingParams


# NOTE: below this a temperature is greedy, as in vLLM: logits / 1e-38 overflow to inf and softmax to nan.
MIN_TEMPERATURE = 1e-5


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    # logits: [B, vocab] float32 -> one token id per row
    return draw(logits, range(len(params)), params, positions, greedy(logits).tolist())


def greedy(logits: torch.Tensor) -> torch.Tensor:
    # logits: [B, vocab] -> [B] argmax's first maximum (max().indices: twice as fast on CPU)
    return logits.max(-1).indices


def draw(logits: torch.Tensor, rows, params: list[SamplingParams], positions: list[int],
         greedy_tokens: list[int]) -> list[int]:
    """Per draw i (logits row `rows[i]`): its greedy token (`greedy`'s, read back already), or a sample where
    its parameters sample."""
    tokens = list(greedy_tokens)
    for i, (row, p, pos) in enumerate(zip(rows, params, positions)):
        if p.temperature >= MIN_TEMPERATURE:
            tokens[i] = _draw(logits[row], p, pos)
    return tokens


def _draw(logits: torch.Tensor, p: SamplingParams, position: int) -> int:
    logits = logits / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if not bool(torch.isfinite(probs).all()):
        raise FloatingPointError(f"sampling: non-finite probabilities at position {position}")
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < p.top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    seed = hash((p.seed if p.seed is not None else 0, position)) & 0x7FFF_FFFF_FFFF_FFFF
    noise = torch.empty(probs.shape[-1], dtype=torch.float32).exponential_(generator=torch.Generator().manual_seed(seed))
    return int((probs.float() / noise.to(probs.device)).argmax())
