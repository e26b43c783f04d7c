"""`bench acceptance` (tokenrouter/bench/acceptance.py): the closed form of the coupled draw's acceptance is what
the engine's own sampler does, it never beats the textbook rule, and the command runs on the tiny pair."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tokenrouter.bench.__main__ import main as bench
from tokenrouter.bench.acceptance import coupled, textbook, visit_tokens
from tokenrouter.engine.sampler import sample
from tokenrouter.engine.sequence import SamplingParams


def distributions(rows: int, vocab: int, seed: int, spread: float = 1.5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(rows, vocab, generator=g) * spread
    q_logits = p_logits + torch.randn(rows, vocab, generator=g)  # a drafter that roughly agrees
    return p_logits, q_logits


def test_the_coupled_closed_form_matches_the_engines_shared_noise_draws():
    p_logits, q_logits = distributions(1, 12, seed=3)
    n = 4000
    agree = 0
    for s in range(n):  # both models draw position 7 of request s with the engine's sampler
        params = [SamplingParams(temperature=1.0, seed=s)]
        agree += sample(p_logits, params, [7]) == sample(q_logits, params, [7])
    p, q = torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)
    exact, upper = coupled(p, q)
    rate = agree / n
    sigma = math.sqrt(rate * (1 - rate) / n)
    assert abs(rate - float(exact[0])) < 4.5 * sigma  # seeds fixed: the same draws every run
    assert float(upper[0]) == pytest.approx(float(exact[0]))  # every token was a candidate
    assert float(exact[0]) < float(textbook(p, q)[0])  # this pair of distributions is not degenerate


def test_coupled_never_beats_textbook_and_its_bound_holds_when_candidates_are_cut():
    p_logits, q_logits = distributions(6, 300, seed=1, spread=0.5)
    p, q = torch.softmax(p_logits, -1), torch.softmax(q_logits, -1)
    full, _ = coupled(p, q, candidates=300)
    cut, upper = coupled(p, q, candidates=8)
    best = textbook(p, q).double()
    assert torch.all(full <= best + 1e-9)
    assert torch.all(full >= best / (2 - best) - 1e-9)  # (1 - TV) / (1 + TV), the communication-free bound
    assert torch.all(cut <= full + 1e-12) and torch.all(full <= upper + 1e-9)
    assert torch.all(cut < full)  # eight candidates of 300 flat-ish tokens leave some out
    same, _ = coupled(p, p, candidates=300)
    assert torch.allclose(same, torch.ones(6, dtype=torch.float64))  # one model agrees with itself


def test_tokens_per_visit():
    assert visit_tokens(1.0, 4) == 5
    assert visit_tokens(0.0, 4) == 1
    assert visit_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_the_command_runs_on_the_tiny_pair(tmp_path, capsys):
    out = tmp_path / "acceptance.json"
    bench(["acceptance", "--config", "config/tiny/pair.yaml", "--num-prompts", "2", "--max-tokens", "6",
           "--temperatures", "0,1", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["temperature"] for r in rows] == [0, 1]
    assert all(0 < r["positions"] <= 12 for r in rows)
    greedy, sampled = rows
    assert greedy["textbook"] == greedy["coupled"] == greedy["greedy"]
    assert 0 <= sampled["coupled"] <= sampled["coupled_upper"] <= sampled["textbook"] + 1e-9 <= 1 + 1e-9
    assert "coupled/textbook" in capsys.readouterr().out
