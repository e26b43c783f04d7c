"""Verification on fake workers: the large model judges the drafts it catches up on, rolls the sequence back at
the first it would not have written, and the output is exactly the large model's (engine/verification.py)."""
from __future__ import annotations

import asyncio

import pytest

from tokenrouter.config import EngineConfig, ModelSpec, SchedulerSpec
from tokenrouter.engine.block_manager import BlockManager, KVState
from tokenrouter.engine.detokenizer import Detokenizer
from tokenrouter.engine.fake_worker import default_token, fake_executors
from tokenrouter.engine.runtime import Runtime
from tokenrouter.engine.sequence import SamplingParams
from tokenrouter.engine.verification import judge, num_outputs
from tokenrouter.models.tiny import byte_tokenizer
from tokenrouter.policies import make_policy, parse_policy

MODELS = ["small", "large"]
STOP_ID = 250  # outside default_token's range


def small_errs(view, model) -> int:
    """The large model writes default_token; the small one drafts a wrong token at every 7th length."""
    t = default_token(view, model)
    return t + 1 if model == "small" and len(view.token_ids) % 7 == 3 else t


def reference(prompt: list[int], max_tokens: int, token=default_token, stop: tuple[int, ...] = ()) -> list[int]:
    class View:
        token_ids = list(prompt)

    for _ in range(max_tokens):
        View.token_ids.append(token(View, "large"))
        if View.token_ids[-1] in stop:
            break
    return View.token_ids[len(prompt):]


def serve(prompts, policy, max_tokens=23, scheduler=None, stop=(), abort_after=None, **fake):
    config = EngineConfig([ModelSpec(m, "fake") for m in MODELS], scheduler=scheduler or SchedulerSpec())
    executors = fake_executors(MODELS, **fake)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop)

    async def main():
        runtime = Runtime(config, executors, byte_tokenizer())
        runtime.start()
        seqs = [runtime.submit(p, params, policy) for p in prompts]
        streamed = []
        for seq in seqs:
            got = []
            while (record := await seq.stream.get()) is not None:
                got.append(record)
                if abort_after is not None and len(got) == abort_after:
                    runtime.abort(seq)
            streamed.append(got)
        runtime.close()
        return runtime, seqs, streamed

    runtime, seqs, streamed = asyncio.run(main())
    return runtime, seqs, streamed, {m: e.worker for m, e in executors.items()}


def all_blocks_back(runtime) -> bool:
    return all(s.blocks.num_free_blocks == s.blocks.num_blocks for s in runtime.subservers.values())


PROMPTS = [list(range(7, 7 + n)) for n in (3, 8, 13, 21)]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_verify_every_k_writes_the_large_models_output(k):
    runtime, seqs, streamed, workers = serve(PROMPTS, make_policy("verify", every=k), token=small_errs)
    for prompt, seq, got in zip(PROMPTS, seqs, streamed):
        assert seq.output_ids == reference(prompt, 23)
        assert got == seq.records  # nothing the reader saw was taken back
        corrections = [r for r in seq.records if r.correction]
        assert corrections and all(r.model == "large" for r in corrections)
        assert all(r.verified for r in seq.records if r.model == "small")
        assert seq.drafted - seq.accepted >= len(corrections) > 0
    assert all_blocks_back(runtime)
    # every visit after the first catches up on the large model's own token and at most k drafts
    starts = {}
    for row in workers["large"].rows:
        if row.seq_id in starts:
            assert len(row.token_ids) <= k + 1
        starts[row.seq_id] = row.start


def test_a_cut_moves_every_watermark_back_and_the_small_model_recomputes_from_it():
    runtime, (seq,), _, workers = serve([list(range(7, 17))], make_policy("verify", every=4), token=small_errs)
    assert seq.output_ids == reference(list(range(7, 17)), 23)
    rows = workers["small"].rows
    # the small model never recomputes a position twice except the ones a cut took back
    for before, after in zip(rows, rows[1:]):
        if before.seq_id == after.seq_id:
            assert after.start <= before.start + len(before.token_ids)
    assert any(after.start < before.start + len(before.token_ids) for before, after in zip(rows, rows[1:]))
    assert all_blocks_back(runtime)


def test_verify_of_a_policy_judges_what_the_large_model_missed_at_each_send():
    every_third = lambda view, model: view.num_output_tokens % 3 == 2  # noqa: E731
    policy = make_policy("verify", of="all-small", hold=6)
    runtime, seqs, streamed, _ = serve(PROMPTS, policy, token=small_errs, send=every_third)
    for prompt, seq, got in zip(PROMPTS, seqs, streamed):
        assert seq.output_ids == reference(prompt, 23)
        assert got == seq.records
    assert all_blocks_back(runtime)


def test_verify_of_a_wrapped_wrapper_runs_from_its_spec_string():
    every_third = lambda view, model: view.num_output_tokens % 3 == 2  # noqa: E731
    policy = parse_policy("verify:of=(rolling:of=all-small,window=2),hold=6")
    assert policy.spec == ("verify", {"of": "rolling:of=all-small,window=2", "hold": 6})  # a worker elsewhere rebuilds it
    runtime, seqs, _, _ = serve(PROMPTS, policy, token=small_errs, send=every_third)
    for prompt, seq in zip(PROMPTS, seqs):
        assert seq.output_ids == reference(prompt, 23) and seq.drafted > 0
    assert all_blocks_back(runtime)


def test_hold_bounds_the_drafts_when_the_wrapped_policy_never_sends():
    runtime, (seq,), _, workers = serve([list(range(7, 15))], make_policy("verify", of="all-small", hold=3),
                                        token=small_errs)
    assert seq.output_ids == reference(list(range(7, 15)), 23)
    assert all(len(r.token_ids) <= 4 for r in workers["large"].rows[1:])
    assert all_blocks_back(runtime)


def test_a_drafted_stop_token_the_large_model_rejects_does_not_finish_the_sequence():
    def small_stops(view, model):
        return STOP_ID if model == "small" and len(view.token_ids) % 6 == 0 else default_token(view, model)

    prompt = list(range(7, 15))
    runtime, (seq,), _, _ = serve([prompt], make_policy("verify", every=3), token=small_stops, stop=(STOP_ID,))
    assert seq.output_ids == reference(prompt, 23) and str(seq.finish_reason) == "length"
    assert all_blocks_back(runtime)


def test_a_drafted_stop_token_the_large_model_accepts_finishes_without_a_bonus_token():
    def both_stop(view, model):
        return STOP_ID if len(view.token_ids) == 19 else default_token(view, model)

    prompt = list(range(7, 15))
    runtime, (seq,), _, _ = serve([prompt], make_policy("verify", every=4), token=both_stop, stop=(STOP_ID,))
    assert seq.output_ids == reference(prompt, 23, both_stop, (STOP_ID,)) and seq.output_ids[-1] == STOP_ID
    assert str(seq.finish_reason) == "stop" and seq.records[-1].model == "small" and seq.records[-1].verified
    assert all_blocks_back(runtime)


def test_verification_under_preemption_frees_every_block():
    prompts = [list(range(3, 3 + 6 + i)) for i in range(8)]
    runtime, seqs, _, _ = serve(prompts, make_policy("verify", every=4), max_tokens=20, token=small_errs,
                                num_blocks=24, block_size=4, scheduler=SchedulerSpec(max_num_seqs=8))
    assert sum(s.scheduler.num_preemptions for s in runtime.subservers.values()) > 0
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_ids == reference(prompt, 20)
    assert all_blocks_back(runtime)


def test_a_split_catch_up_keeps_every_draft_in_its_last_chunk():
    prompt = list(range(3, 40))
    runtime, (seq,), _, workers = serve([prompt], make_policy("verify", every=4), token=small_errs,
                                        scheduler=SchedulerSpec(max_num_batched_tokens=8))
    assert seq.output_ids == reference(prompt, 23)
    assert all(len(r.token_ids) <= 8 for w in workers.values() for r in w.rows)
    assert all_blocks_back(runtime)


def test_an_abort_while_drafts_wait_frees_every_block_and_releases_only_settled_tokens():
    runtime, (seq,), (got,), _ = serve([list(range(7, 15))], make_policy("verify", every=8), max_tokens=200,
                                       token=small_errs, abort_after=3)
    assert seq.finish_reason.kind == "abort" and got == seq.records
    assert seq.num_drafts == 0
    assert all_blocks_back(runtime)


def test_hold_beyond_the_step_budget_is_refused_at_submit():
    config = EngineConfig([ModelSpec(m, "fake") for m in MODELS], scheduler=SchedulerSpec(max_num_batched_tokens=8))
    runtime = Runtime(config, fake_executors(MODELS), byte_tokenizer())
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        runtime.submit([5, 6], SamplingParams(), make_policy("verify", every=8))


# ---- the pieces ------------------------------------------------------------------------------------------
def test_judge_accepts_the_longest_agreeing_prefix():
    assert judge([1, 2, 3], [1, 2, 3, 4]) == (3, 4)
    assert judge([1, 2, 3], [1, 5, 3, 4]) == (1, 5)
    assert judge([], [9]) == (0, 9)
    assert judge([1, 2, 3], [1, 5, 6, 4], [True, True, False]) == (2, 6)  # a tolerated draft is accepted
    assert num_outputs(0, 10, 5, True) == 1 and num_outputs(12, 10, 5, False) == 1
    assert num_outputs(12, 10, 5, True) == 4  # positions 11..14 judge tokens 12..14 and predict 15
    assert num_outputs(3, 10, 5, True) == 5  # never the chunk's first token


def test_truncate_frees_the_blocks_past_the_cut():
    blocks = BlockManager(8, 4)
    kv = KVState()
    blocks.allocate(kv, 14)
    kv.num_cached = 14
    blocks.truncate(kv, 9)
    assert len(kv.block_table) == 3 and kv.num_cached == 9 and blocks.num_free_blocks == 5
    blocks.truncate(kv, 0)
    assert kv.block_table == [] and kv.num_cached == 0 and blocks.num_free_blocks == 8


def test_the_detokenizer_truncates_to_its_state_at_the_cut():
    tok = byte_tokenizer()
    prompt = list(b"> ")
    text = "héllo wörld".encode()
    ids = prompt + list(text)
    full = Detokenizer(tok, len(prompt))
    for i in range(len(prompt) + 1, len(ids) + 1):
        full.step(ids[:i])
    for cut in range(len(prompt), len(ids) + 1):
        d = Detokenizer(tok, len(prompt))
        for i in range(len(prompt) + 1, len(ids) + 1):
            d.step(ids[:i])
        d.truncate(cut)
        fresh = Detokenizer(tok, len(prompt))
        for i in range(len(prompt) + 1, cut + 1):
            fresh.step(ids[:i])
        assert (d.text, d.prefix_offset, d.read_offset) == (fresh.text, fresh.prefix_offset, fresh.read_offset)
        for i in range(cut + 1, len(ids) + 1):  # and it goes on exactly as one that never went past the cut
            assert d.step(ids[:i]) == fresh.step(ids[:i])
    assert full.text == "héllo wörld"


def test_verify_specs_parse_and_bad_ones_name_the_field():
    assert parse_policy("verify:4").describe() == "verify:every=4"
    assert parse_policy("verify:of=confidence,threshold=0.8").describe() == "verify:of=confidence,threshold=0.8,hold=32"
    assert parse_policy("verify:of=confidence,threshold=0.8,hold=8").draft_limit == 8
    assert parse_policy("verify").describe() == "verify:every=4"
    assert parse_policy("verify:of=confidence,threshold=0.8,tolerance=0.5").describe() == \
        "verify:of=confidence,threshold=0.8,hold=32,tolerance=0.5"
    for spec, field in [("verify:every=0", "every"), ("verify:every=2,of=entropy", "verify"),
                        ("verify:of=query-confidence", "of"), ("verify:of=confidence,hold=0", "hold"),
                        ("verify:every=2,hold=3", "verify:every"), ("verify:every=2,tolerance=0", "tolerance"),
                        ("verify:of=confidence,tolerance=1.5", "tolerance")]:
        with pytest.raises(ValueError, match=field):
            parse_policy(spec)
