"""Rolling-window and momentum wrappers: per-sequence state, batching, and cleanup on finish."""
from __future__ import annotations

import gc

import pytest
import torch

from tokenrouter.engine.sequence import SeqStatus
from tokenrouter.policies import Policy, StepFeatures, make_policy, parse_policy

from conftest import make_seq


class Scripted(Policy):
    """Scores read from a table by (prompt's first token, output position)."""
    name = "scripted"

    def scores(self, f: StepFeatures) -> torch.Tensor:
        return torch.tensor([TABLE[s.prompt_ids[0]][s.num_output_tokens] for s in f.seqs])


TABLE = {1: [1.0, 0.0, 0.0, 1.0, 1.0, 1.0], 2: [0.0, 4.0, 0.0, 0.0, 0.0, 0.0]}


@pytest.fixture(autouse=True)
def scripted(monkeypatch):
    from tokenrouter import policies

    monkeypatch.setitem(policies.POLICIES, "scripted", Scripted)


def run(policy: Policy, seqs, steps: int, batched: bool = True) -> list[list[float]]:
    out = [[] for _ in seqs]
    for _ in range(steps):
        groups = [list(range(len(seqs)))] if batched else [[i] for i in range(len(seqs))]
        for rows in groups:
            f = StepFeatures(torch.zeros(len(rows), 4), torch.zeros(len(rows), 2), [seqs[i] for i in rows])
            for i, score in zip(rows, policy.scores(f).tolist()):
                out[i].append(score)
        for s in seqs:
            s.token_ids.append(0)
    return out


def test_rolling_mean_over_each_sequence_window():
    scores = run(parse_policy("rolling:of=scripted,window=2"), [make_seq([1]), make_seq([2])], 6)
    assert scores[0] == pytest.approx([1.0, 0.5, 0.0, 0.5, 1.0, 1.0])
    assert scores[1] == pytest.approx([0.0, 2.0, 2.0, 0.0, 0.0, 0.0])


def test_momentum_starts_at_the_first_score():
    scores = run(make_policy("momentum", of="scripted", beta=0.5), [make_seq([1])], 4)
    assert scores[0] == pytest.approx([1.0, 0.5, 0.25, 0.625])


def test_a_position_scored_twice_counts_once():
    policy = parse_policy("rolling:of=scripted,window=3")
    seq = make_seq([2])
    f = StepFeatures(torch.zeros(1, 4), torch.zeros(1, 2), [seq])
    policy.scores(f)
    seq.token_ids.append(0)
    assert policy.scores(f).item() == pytest.approx(2.0)
    assert policy.scores(f).item() == pytest.approx(2.0)


@pytest.mark.parametrize("spec", ["rolling:of=scripted,window=3", "momentum:of=scripted,beta=0.8"])
def test_batched_equals_one_at_a_time(spec):
    seqs_a, seqs_b = [make_seq([1]), make_seq([2])], [make_seq([1]), make_seq([2])]
    assert run(parse_policy(spec), seqs_a, 6) == run(parse_policy(spec), seqs_b, 6, batched=False)


def test_state_is_dropped_when_a_sequence_finishes_or_disappears():
    policy = parse_policy("rolling:of=scripted,window=3")
    done, gone, live = make_seq([1]), make_seq([2]), make_seq([1])
    run(policy, [done, gone, live], 2)
    assert len(policy.state) == 3
    done.status = SeqStatus.FINISHED
    del gone
    gc.collect()
    run(policy, [live], 1)
    assert len(policy.state) == 1


def test_threshold_defaults_to_the_inner_policys_and_wrappers_refuse_query_policies():
    assert parse_policy("rolling:of=entropy,threshold=2.5").threshold == 2.5
    assert make_policy("momentum", of="entropy").threshold == make_policy("entropy").threshold
    with pytest.raises(ValueError, match="of:"):
        make_policy("rolling", of="query-random")
    with pytest.raises(ValueError, match="window"):
        make_policy("rolling", of="entropy", window=0)
