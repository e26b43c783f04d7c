"""Verification: the verifier (the large model) judges the drafts (the home model's tokens) it catches up on.

A verifying policy (`verify:every=k`, `verify:of=POLICY`, tokenrouter/policies/verify.py) leaves the tokens its
home model writes unsettled: they are drafts, held from the reader. The sequence goes to the verifier when the
policy sends it, when `draft_limit` drafts wait, or when a draft would finish the sequence. The verifier's
catch-up chunk then returns logits at every drafted position and its worker draws its own token at each, the
same draw it would make writing the sequence itself (the sampler's noise depends only on seed and position).
Drafts are accepted while they equal those draws; at the first that does not, the sequence is cut there and
the verifier's token replaces it; if all are accepted, the verifier's token after them follows. Every output
token is thus the one the verifier writes after the same prefix, greedy or sampled: `verify:every=k` writes
all-large's output, only faster when drafts are accepted.

A policy's `tolerance` r (0 < r <= 1) makes verification lossy on purpose, as the rollback rule of Big Little
Decoder (Kim et al., NeurIPS 2023): a draft is also accepted when the verifier finds it at least r times as likely
as its own draw there. Fewer drafts are rolled back (less rework for both models, fewer corrections), and the
output is no longer exactly the verifier's.

NOTE: the textbook speculative-sampling rule (accept with min(1, p/q), else draw from the residual) needs the
draft model's whole distribution at the verifier: a vocabulary-sized vector per draft crossing the worker
boundary. The coupled draw is the Gumbel-sampling protocol of "drafter-invariant speculative decoding" (Daliri,
Musco, Suresh, arXiv 2408.07978): nothing crosses, the verifier's distribution is kept exactly, the output is fixed
by the seed whatever drafted it, and it accepts at least (1 - TV) / (1 + TV) where the textbook rule accepts
1 - TV. `python -m tokenrouter.bench acceptance` computes both rates on a model pair (docs/policies.md).
"""
from __future__ import annotations

import math

import torch


def judged_from(verify_from: int, start: int) -> int:
    """The first token a verifying chunk starting at `start` judges: a token is judged by the logits at the
    position before it, so never the chunk's first token (the scheduler starts the chunk early enough)."""
    return max(verify_from, start + 1)


def num_outputs(verify_from: int, start: int, num_tokens: int, complete: bool) -> int:
    """Logit rows a chunk needs: one per judged draft plus the next token's (one for a plain chunk)."""
    if not (verify_from and complete):
        return 1
    return max(1, start + num_tokens - judged_from(verify_from, start) + 1)


def apply(seq, first: int, accepted: int, blocks: dict, tolerated: list[int] = ()) -> bool:
    """The verifier judged `seq`'s drafts from `first` on and accepted `accepted` (`tolerated`: the offsets of
    those it would not have written itself): mark and count them, and cut the sequence at the first rejected one
    (its tokens, records and text; every model's watermark and the blocks past the cut, `blocks` by model).
    True: a draft was rejected (the verifier's token is a correction)."""
    end, p = len(seq.token_ids), seq.num_prompt_tokens
    for record in seq.records[first - p:first - p + accepted]:
        record.verified = True
    for k in tolerated:
        seq.records[first - p + k].tolerated = True
    seq.drafted += end - first
    seq.accepted += accepted
    if first + accepted == end:
        seq.settled = end
        return False
    seq.cut(first + accepted)
    for name, kv in seq.kv.items():
        blocks[name].truncate(kv, first + accepted)
    return True


def judge(drafts: list[int], draws: list[int], tolerated: list[bool] | None = None) -> tuple[int, int]:
    """(drafts accepted, the verifier's token): drafts are accepted while they equal the verifier's draws at
    their positions (or `tolerated` says the verifier finds them likely enough, `tolerable`); its token is its
    draw at the first one rejected, or after the last (`draws` is one longer)."""
    accepted = 0
    while accepted < len(drafts) and (drafts[accepted] == draws[accepted] or (tolerated and tolerated[accepted])):
        accepted += 1
    return accepted, draws[accepted]


def tolerable(logits, drafts: list[int], draws: list[int], temperature: float, tolerance: float) -> list[bool]:
    """Per draft: whether the verifier gives it at least `tolerance` times the probability of its own draw there,
    p(draft) >= tolerance * p(draw), in its distribution at the row's temperature (1 for greedy rows) before
    top-k / top-p; `logits` holds one row per draft. The ratio needs no softmax: exp((logit[draft] - logit[draw]) / T)."""
    index = torch.arange(len(drafts))
    gap = logits[index, torch.tensor(drafts)] - logits[index, torch.tensor(draws)]
    return (gap / temperature >= math.log(tolerance)).tolist()
