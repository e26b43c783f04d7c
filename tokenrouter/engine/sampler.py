"""Token sampling: greedy, or temperature / top-k / top-p with a per-request, per-position seed.

Seeding each draw by (seed, position) makes a sampled token independent of batching and of which
model produced the earlier tokens, so the engine and the baselines draw the same token.

NOTE: a draw is an exponential race, argmax(p / E) with E ~ Exp(1) per vocabulary entry, which picks
entry i with probability p_i. The noise E depends only on (seed, position) (a counter-based hash computed on the
logits' device, `exponential_noise`), so two models drawing the same position of the same request share it: they
draw the same token wherever their distributions agree, and a model's draw does not depend on its device. Verification rests on this
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
    its parameters sample. The sampled rows are drawn together on the logits' device and read back in one copy."""
    tokens = list(greedy_tokens)
    sampled = [i for i, p in enumerate(params) if p.temperature >= MIN_TEMPERATURE]
    if sampled:
        drawn = _draw(logits[torch.tensor([rows[i] for i in sampled], device=logits.device)],
                      [params[i] for i in sampled], [positions[i] for i in sampled])
        for i, token in zip(sampled, drawn):
            tokens[i] = token
    return tokens


def _draw(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """One token per row of `logits` [R, vocab]: temperature, top-k, top-p, then the exponential race. Where every
    row has a top-k, only its top-k candidates are scored (a sort and noise over the whole vocabulary cost the host
    milliseconds per row on a CPU); the draw is the same, since entries outside the top-k have probability 0."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    top_k = [min(p.top_k, vocab) if p.top_k else vocab for p in params]
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    entries = None  # [R, K] vocabulary ids of the candidates, descending (None: the whole vocabulary)
    if max(top_k) < vocab:
        values, entries = torch.topk(logits.float(), max(top_k))
        values = values.masked_fill(torch.arange(max(top_k), device=device) >= torch.tensor(top_k, device=device)[:, None],
                                    float("-inf"))
        probs = torch.softmax(values / temperature, -1)
        ordered = probs  # already in descending order
    else:
        probs = torch.softmax(logits.float() / temperature, -1)
        ordered, order = probs.sort(-1, descending=True) if min(p.top_p for p in params) < 1.0 else (None, None)
    if min(p.top_p for p in params) < 1.0:
        keep = ordered.cumsum(-1) - ordered < top_p  # always keeps each row's most likely token
        probs = ordered * keep if entries is not None else torch.zeros_like(probs).scatter_(1, order, ordered * keep)
    finite = probs.isfinite().all(-1)
    candidates = entries if entries is not None else torch.arange(vocab, device=device)[None, :]
    choice = (probs / exponential_noise(params, positions, candidates)).argmax(-1)
    if entries is not None:
        choice = entries.gather(1, choice[:, None])[:, 0]
    tokens, ok = torch.stack([choice, finite.long()]).tolist()  # one read back for the whole step
    bad = [pos for pos, good in zip(positions, ok) if not good]
    if bad:
        raise FloatingPointError(f"sampling: non-finite probabilities at position {bad[0]}")
    return tokens


MASK32 = 0xFFFF_FFFF
GOLDEN = 0x9E37_79B1  # spreads the entry index over 32 bits
MIX = (0x7FEB_352D, 0x5F35_6495, 0x2C1B_3C6D)  # odd and below 2**31: every product stays below 2**63 (int64, no overflow)


def exponential_noise(params: list[SamplingParams], positions: list[int], entries: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise for vocabulary `entries` ([R, N] or [1, N]) of each row, a function of the row's (seed, position)
    and the entry alone: a counter-based integer hash evaluated on the entries' device in int64 arithmetic, so a
    step draws all its rows without a host-side generator or a vocabulary-sized copy per row, and any device computes
    the same bits (the last float32 ulp of -log may differ between devices: a draw changes only on a tie to that
    precision)."""
    keys = torch.tensor([hash((p.seed if p.seed is not None else 0, pos)) & MASK32 for p, pos in zip(params, positions)],
                        dtype=torch.int64, device=entries.device)
    x = (keys[:, None] + entries.long() * GOLDEN) & MASK32
    for c in MIX:
        x = ((x ^ (x >> 16)) * c) & MASK32
    x = x ^ (x >> 16)
    uniform = ((x >> 8).float() + 0.5) / 2**24  # (0, 1), 24 bits: exact in float32
    return -torch.log(uniform)
