"""Our decoder on a paged KV cache against Hugging Face transformers, tiny random models of each family."""
from __future__ import annotations

import pytest
import torch

from tokenrouter.config import ModelSpec
from tokenrouter.engine.block_manager import BlockManager, KVState
from tokenrouter.engine.model_runner import Chunk, ModelRunner
from tokenrouter.models.tiny import VOCAB_SIZE, build_tiny_model_dir

FAMILIES = ["llama", "qwen2", "qwen3"]
ATOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model_dir(request.param)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = ModelRunner(ModelSpec(name=request.param, source=f"tiny:{request.param}", block_size=4,
                                   num_kv_blocks=128), model_dir)
    return hf, runner


@torch.no_grad()
def reference(hf, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    out = hf(torch.tensor([token_ids]), output_hidden_states=True)
    return out.logits[0].float(), out.hidden_states[-1][0]


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def chunk_for(blocks: BlockManager, kv: KVState, tokens: list[int], start: int, end: int, num_outputs=1) -> Chunk:
    blocks.allocate(kv, end)
    return Chunk(tokens[start:end], start, kv.block_table, num_outputs)


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= ATOL


def test_prefill_matches_every_position(pair):
    hf, runner = pair
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seqs = [random_tokens(n, seed=n) for n in (7, 13, 1)]
    kvs = [KVState() for _ in seqs]
    out = runner.run([chunk_for(blocks, kv, s, 0, len(s), num_outputs=len(s)) for kv, s in zip(kvs, seqs)])
    for i, s in enumerate(seqs):
        logits, hidden = reference(hf, s)
        rows = slice(out.offsets[i], out.offsets[i] + len(s))
        assert_close(out.logits[rows], logits)
        assert_close(out.hidden[rows], hidden)


def test_catch_up_prefill_after_cached_tokens(pair):
    hf, runner = pair
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    tokens = random_tokens(21, seed=5)
    kv = KVState()
    runner.run([chunk_for(blocks, kv, tokens, 0, 6)])
    out = runner.run([chunk_for(blocks, kv, tokens, 6, 21, num_outputs=15)])
    logits, hidden = reference(hf, tokens)
    assert_close(out.logits, logits[6:])
    assert_close(out.hidden, hidden[6:])


def test_batched_decode_of_different_lengths(pair):
    hf, runner = pair
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seqs = [random_tokens(n, seed=100 + n) for n in (5, 17, 9, 3)]
    kvs = [KVState() for _ in seqs]
    runner.run([chunk_for(blocks, kv, s, 0, len(s) - 2) for kv, s in zip(kvs, seqs)])
    for step in (2, 1):
        out = runner.run([chunk_for(blocks, kv, s, len(s) - step, len(s) - step + 1) for kv, s in zip(kvs, seqs)])
        for i, s in enumerate(seqs):
            logits, hidden = reference(hf, s)
            assert_close(out.logits[i], logits[len(s) - step])
            assert_close(out.hidden[i], hidden[len(s) - step])


def test_mixed_batch_prefill_catch_up_and_decode(pair):
    hf, runner = pair
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    fresh, caught_up, decoding = random_tokens(11, 1), random_tokens(19, 2), random_tokens(8, 3)
    kv_fresh, kv_catch, kv_dec = KVState(), KVState(), KVState()
    runner.run([chunk_for(blocks, kv_catch, caught_up, 0, 4), chunk_for(blocks, kv_dec, decoding, 0, 7)])
    out = runner.run([
        chunk_for(blocks, kv_fresh, fresh, 0, 11),
        chunk_for(blocks, kv_catch, caught_up, 4, 19, num_outputs=3),
        chunk_for(blocks, kv_dec, decoding, 7, 8),
    ])
    assert out.logits.shape == (1 + 3 + 1, VOCAB_SIZE)
    assert_close(out.logits[0], reference(hf, fresh)[0][-1])
    assert_close(out.logits[1:4], reference(hf, caught_up)[0][-3:])
    assert_close(out.logits[4], reference(hf, decoding)[0][-1])


def test_runner_rejects_a_block_table_too_small(pair):
    _, runner = pair
    with pytest.raises(ValueError, match="block table"):
        runner.run([Chunk(random_tokens(9, 0), 0, [0, 1])])


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_runner_is_as_close_to_float32_as_transformers_bfloat16(family):
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model_dir(family)
    runner = ModelRunner(ModelSpec(name=family, source=f"tiny:{family}", block_size=4, num_kv_blocks=32,
                                   dtype="bfloat16"), model_dir)
    tokens = random_tokens(20, seed=1)
    blocks, kv = BlockManager(runner.num_blocks, runner.block_size), KVState()
    ours = runner.run([chunk_for(blocks, kv, tokens, 0, 20, num_outputs=20)]).logits
    exact, _ = reference(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), tokens)
    theirs, _ = reference(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval(), tokens)
    assert ours.dtype == torch.float32
    assert (ours - exact).abs().max() <= 1.5 * (theirs - exact).abs().max() + 1e-2


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_a_long_chunk_s_mlp_in_slices_of_rows_gives_the_same_logits(dtype, monkeypatch):
    from tests.models.runner_steps import steps
    from tokenrouter.models import decoder

    spec = ModelSpec(name="m", source="tiny:qwen2", block_size=4, num_kv_blocks=128, dtype=dtype)
    runner = ModelRunner(spec, build_tiny_model_dir("qwen2"))
    whole = steps(runner)
    mlp = runner.model.layers[0].mlp
    calls, rows = [], decoder.MLP.rows
    monkeypatch.setattr(decoder, "MLP_SLICE_BYTES", mlp.gate_up_proj.out_features * 4 * 3)  # three rows a slice
    monkeypatch.setattr(decoder.MLP, "rows", lambda self, x: calls.append(len(x)) or rows(self, x))
    sliced = steps(runner)
    assert calls and max(calls) == 3 and len(calls) > len(whole) * len(runner.model.layers)
    for a, b in zip(whole, sliced):
        assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()
