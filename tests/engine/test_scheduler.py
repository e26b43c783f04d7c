"""Scheduling without a model: budgets, chunked prefill, preemption by recompute."""
from __future__ import annotations

from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.scheduler import Scheduler
from tokenrouter.engine.sequence import SamplingParams, Sequence
from tokenrouter.policies import make_policy


def seq(n: int) -> Sequence:
    return Sequence(list(range(n)), SamplingParams(), make_policy("all-small"), "small")


def test_prefill_is_chunked_under_the_token_budget():
    sched = Scheduler("small", BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq(7), seq(9)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [(s, len(r.token_ids), r.complete) for s, r in zip(batch.seqs, batch.rows)] == [(a, 7, True), (b, 3, False)]


def test_waiting_sequences_holding_blocks_give_them_up():
    # a sequence handed back to a model keeps its old blocks while it waits; when the pool is full of
    # such sequences, the front one must still get its blocks (by preempting the others), not stall.
    blocks = BlockManager(4, 4)
    sched = Scheduler("large", blocks, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(8), seq(8)
    for s in (a, b):
        blocks.allocate(s.kv_at("large"), 8)
        s.kv_at("large").num_cached = 8
        s.token_ids += [1, 2]  # tokens the model missed while the sequence was away
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == [a]
    assert b.kv_at("large").block_table == [] and b.kv_at("large").num_cached == 0
    assert sched.num_preemptions == 1
    assert batch.rows[0].start == 8 and batch.rows[0].token_ids == [1, 2]


def test_parked_sequences_are_preempted_before_running_ones():
    blocks = BlockManager(4, 4)
    sched = Scheduler("small", blocks, max_num_seqs=8, max_num_batched_tokens=64)
    parked, new = seq(8), seq(8)
    sched.add(parked)
    sched.schedule()
    parked.kv_at("small").num_cached = 8
    sched.park(parked)
    sched.add(new)
    sched.add(seq(4))  # does not fit until the parked one gives its blocks up
    batch = sched.schedule()
    assert len(batch) == 2 and parked.kv_at("small").block_table == []
