"""Draft acceptance, rule against rule: how often the large model would accept the small model's token at each
position of the large model's own responses, under the coupled draw the engine uses and under the textbook
speculative-sampling rule. Exact, from both models' distributions (both teacher-forced on the same responses),
not estimated from engine runs.

- textbook (accept a draft x ~ q with probability min(1, p(x)/q(x)), else draw from the residual): a draft is
  accepted with probability sum_i min(p_i, q_i), the most any rule that keeps p can accept.
- coupled (tokenrouter/engine/verification.py: both models race the same exponential noise, x = argmax q/E,
  y = argmax p/E, accept when x == y): with E_i = e, x = y = i needs E_j > e * max(p_j/p_i, q_j/q_i) for every
  j != i; integrating over e ~ Exp(1) gives P(x = y = i) = 1 / sum_j max(p_j/p_i, q_j/q_i).
  Each term is at most min(p_i, q_i), so the sum runs over the `candidates` tokens with the largest
  min(p_i, q_i); `coupled_upper` adds back the min-mass of the rest, a bound on what was left out.
  This is the Gumbel-sampling protocol of Daliri, Musco and Suresh, "Coupling without Communication and
  Drafter-Invariant Speculative Decoding" (arXiv 2408.07978): with shared randomness and nothing sent between
  the models it accepts at least (1 - TV) / (1 + TV), TV = 1 - textbook, which no communication-free rule
  beats in the worst case; in exchange the output is fixed by the seed whichever model drafted.

Greedy (temperature 0) acceptance is the share of positions where both argmaxes agree, under either rule.
"""
from __future__ import annotations

import argparse
import time

import torch

from tokenrouter.bench import checks, write_json
from tokenrouter.bench.machine import announce
from tokenrouter.config import load_config
from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.sequence import SamplingParams

DRAFTS = (1, 2, 4, 8)  # k of verify:every=k, for the tokens-per-visit columns


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tokenrouter.training.train import DEFAULT_PROMPTS

    p.add_argument("--config", required=True, help="its first model drafts, its last verifies")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL, one {\"prompt\": ...} per line")
    p.add_argument("--num-prompts", type=int, default=16, help="the first N prompts of the file")
    p.add_argument("--max-tokens", type=int, default=96, help="of each large-model response")
    p.add_argument("--temperatures", default="0,0.7,1.0", help="comma-separated; 0 is greedy")
    p.add_argument("--candidates", type=int, default=256, help="tokens per position in the coupled sum")
    p.add_argument("--seed", type=int, default=0, help="responses at temperature > 0 are sampled with seed + i")
    p.add_argument("--json", default="", help="write the results here")


def temperatures(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--temperatures: expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0 <= t <= 100 for t in values):
        raise ValueError(f"--temperatures: expected numbers in [0, 100], got {text!r}")
    return values


def check_args(args: argparse.Namespace) -> None:
    """Every argument, before any model loads (raises ValueError naming the argument)."""
    from tokenrouter.training.dataset import read_prompts

    cfg = checks.config(args.config)
    if len(cfg.models) < 2:
        raise ValueError(f"--config: {args.config} has one model; acceptance needs a drafter and a verifier")
    try:
        read_prompts(args.prompts)
    except (OSError, ValueError) as e:
        raise ValueError(f"--prompts: {e}") from None
    temperatures(args.temperatures)
    for name in ("num_prompts", "max_tokens", "candidates"):
        checks.at_least(getattr(args, name), 1, "--" + name.replace("_", "-"))


def textbook(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[T, V] verifier and drafter distributions -> [T] acceptance probability of min(1, p/q) with residual."""
    return torch.minimum(p, q).sum(-1)


def coupled(p: torch.Tensor, q: torch.Tensor, candidates: int = 256, min_mass: float = 1e-7,
            chunk: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, V] distributions -> ([T] acceptance of the shared-noise race, [T] upper bound on it): the sum of
    1 / sum_j max(p_j/p_i, q_j/q_i) over the tokens i among the `candidates` with the largest min(p_i, q_i)
    whose min(p_i, q_i) exceeds `min_mass`, and that plus the min-mass of the tokens left out."""
    p, q = p.double(), q.double()
    low = torch.minimum(p, q)
    top = low.topk(min(candidates, p.shape[-1]), -1)
    kept = top.values > min_mass
    left_out = (low.sum(-1) - (top.values * kept).sum(-1)).clamp_min(0)
    accept = torch.zeros(p.shape[0], dtype=torch.float64)
    for t in range(p.shape[0]):
        ids = top.indices[t][kept[t]]
        for start in range(0, len(ids), chunk):
            i = ids[start:start + chunk]
            ratios = torch.maximum(p[t] / p[t, i, None], q[t] / q[t, i, None])  # [chunk, V]
            accept[t] += (1 / ratios.sum(-1)).sum()
    return accept, accept + left_out


def visit_tokens(rate: float, k: int) -> float:
    """Expected tokens a visit of verify:every=k writes (accepted drafts plus the verifier's own), with each draft
    accepted with probability `rate` given the ones before it were."""
    return float(k + 1) if rate >= 1 else (1 - rate ** (k + 1)) / (1 - rate)


def responses(runner, prompts: list[list[int]], temperature: float, seed: int, max_tokens: int,
              eos_ids: set[int]) -> list[list[int]]:
    """The verifier's own responses (greedy at temperature 0, else seeded draws as the engine makes them)."""
    from tokenrouter.training.labels import free, generate

    blocks = BlockManager(runner.num_blocks, runner.block_size)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + n) for n in range(len(prompts))]
    with torch.inference_mode():
        seqs = generate(runner, blocks, prompts, params, eos_ids, "verifier")
    free(blocks, seqs, "verifier")
    return [s.token_ids[len(p):] for s, p in zip(seqs, prompts)]


def measure(pair, prompts: list[list[int]], temperature: float, seed: int, max_tokens: int,
            candidates: int) -> dict:
    """One temperature: the rules' acceptance per position, averaged over every response position."""
    from tokenrouter.training.labels import forced_outputs

    answers = responses(pair.large, prompts, temperature, seed, max_tokens, pair.eos_ids)
    small_blocks = BlockManager(pair.small.num_blocks, pair.small.block_size)
    large_blocks = BlockManager(pair.large.num_blocks, pair.large.block_size)
    sums = {"greedy": 0.0, "textbook": 0.0, "coupled": 0.0, "coupled_upper": 0.0}
    positions = 0
    with torch.inference_mode():
        for (q_logits, _), (p_logits, _) in zip(forced_outputs(pair.small, small_blocks, prompts, answers),
                                               forced_outputs(pair.large, large_blocks, prompts, answers)):
            q_logits, p_logits = q_logits.float(), p_logits.float()
            sums["greedy"] += float((q_logits.argmax(-1) == p_logits.argmax(-1)).sum())
            if temperature > 0:
                q, p = torch.softmax(q_logits / temperature, -1), torch.softmax(p_logits / temperature, -1)
                sums["textbook"] += float(textbook(p, q).sum())
                accept, upper = coupled(p, q, candidates)
                sums["coupled"] += float(accept.sum())
                sums["coupled_upper"] += float(upper.sum())
            positions += len(q_logits)
    rates = {k: v / max(positions, 1) for k, v in sums.items()}
    if temperature == 0:  # both rules accept exactly when the argmaxes agree
        rates.update(textbook=rates["greedy"], coupled=rates["greedy"], coupled_upper=rates["greedy"])
    row = {"temperature": temperature, "prompts": len(prompts), "positions": positions, **rates}
    for k in DRAFTS:
        row[f"tokens_per_visit_k{k}_textbook"] = visit_tokens(rates["textbook"], k)
        row[f"tokens_per_visit_k{k}_coupled"] = visit_tokens(rates["coupled"], k)
    return row


def run(args: argparse.Namespace) -> dict:
    from tokenrouter.bench import progress
    from tokenrouter.training.dataset import Pair, read_prompts

    host = announce()
    pair = Pair(load_config(args.config))
    prompts = [pair.encode(p) for p in read_prompts(args.prompts)[:args.num_prompts]]
    rows, levels = [], temperatures(args.temperatures)
    for temperature in progress.bar(len(levels), "temperatures", "T", levels):
        start = time.perf_counter()
        rows.append({**measure(pair, prompts, temperature, args.seed, args.max_tokens, args.candidates),
                     "seconds": time.perf_counter() - start})
    print(f"{args.config}: {pair.describe()['small']} drafts, {pair.describe()['large']} verifies")
    print(f"{'T':>5} {'positions':>9} {'greedy':>7} {'textbook':>9} {'coupled':>8} {'(upper)':>8} "
          f"{'coupled/textbook':>16} {'tok/visit k=4 textbook':>23} {'coupled':>8}")
    for r in rows:
        ratio = r["coupled"] / r["textbook"] if r["textbook"] else float("nan")
        print(f"{r['temperature']:>5g} {r['positions']:>9} {r['greedy']:>7.1%} {r['textbook']:>9.1%} "
              f"{r['coupled']:>8.1%} {r['coupled_upper']:>8.1%} {ratio:>16.3f} "
              f"{r['tokens_per_visit_k4_textbook']:>23.2f} {r['tokens_per_visit_k4_coupled']:>8.2f}")
    result = {"config": args.config, "models": pair.describe(), "machine": host, "num_prompts": len(prompts),
              "max_tokens": args.max_tokens, "candidates": args.candidates, "results": rows}
    if args.json:
        write_json(args.json, result)
    return result
