"""The decode-graph path's static buffers, bucketing and padding, on the CPU stand-in (the same static-buffer
forward, run without capture) against the plain eager path. Capture itself is checked in tests/gpu."""
from __future__ import annotations

import pytest
import torch

from tokenrouter.config import ModelSpec
from tokenrouter.engine.block_manager import BlockManager, KVState
from tokenrouter.engine.cuda_graphs import buckets
from tokenrouter.engine.model_runner import Chunk, ModelRunner
from tokenrouter.models.tiny import VOCAB_SIZE, build_tiny_model_dir


def runner(source: str = "qwen2-large", block_size: int = 4) -> ModelRunner:
    return ModelRunner(ModelSpec("m", f"tiny:{source}", block_size=block_size, num_kv_blocks=256, max_model_len=160),
                       build_tiny_model_dir(source))


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, VOCAB_SIZE, (3 + 5 * i % 17,), generator=g).tolist() for i in range(n)]


def greedy(r: ModelRunner, batch: list[list[int]], steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill each prompt alone, then decode the whole batch greedily; every step's logits, stacked."""
    blocks = BlockManager(r.num_blocks, r.block_size)
    kvs = [KVState() for _ in batch]
    seqs = [list(p) for p in batch]
    for kv, s in zip(kvs, seqs):
        blocks.allocate(kv, len(s))
        s.append(int(r.run([Chunk(list(s), 0, kv.block_table)]).logits[0].argmax()))
    logits = []
    for _ in range(steps):
        for kv, s in zip(kvs, seqs):
            blocks.allocate(kv, len(s))
        out = r.run([Chunk([s[-1]], len(s) - 1, kv.block_table) for kv, s in zip(kvs, seqs)])
        logits.append(out.logits)
        for s, t in zip(seqs, out.logits.argmax(-1).tolist()):
            s.append(t)
    return seqs, torch.stack(logits)


def test_buckets_cover_every_batch_up_to_the_largest():
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 5]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert buckets(20) == [1, 2, 4, 8, 16, 32]
    for top in (1, 7, 16, 33, 100):
        assert all(any(b <= x for x in buckets(top)) for b in range(1, top + 1))


@pytest.mark.parametrize("batch", [1, 3, 5, 16])
@pytest.mark.parametrize("source", ["qwen2-large", "qwen3"])
def test_static_buffer_decode_writes_the_eager_paths_tokens(batch, source):
    plain, graphed = runner(source), runner(source)
    graphed.use_cuda_graphs(16, capture=False)
    calls = []
    run = graphed.graphs.run
    graphed.graphs.run = lambda host: calls.append(len(host.query_lens)) or run(host)
    want, want_logits = greedy(plain, prompts(batch), steps=12)
    got, got_logits = greedy(graphed, prompts(batch), steps=12)
    assert got == want
    assert (got_logits - want_logits).abs().max().item() <= 1e-4
    assert calls == [batch] * 12  # every decode step took the static-buffer path, no prefill did


def test_padded_rows_write_only_the_scratch_block():
    plain, graphed = runner(), runner()
    graphed.use_cuda_graphs(16, capture=False)
    greedy(plain, prompts(3), steps=5)
    greedy(graphed, prompts(3), steps=5)  # 3 rows in a bucket of 4: one padded row a step
    scratch = graphed.scratch_block
    assert torch.allclose(graphed.kv_cache[:, :, :scratch], plain.kv_cache[:, :, :scratch], atol=1e-5)
    assert graphed.kv_cache[:, :, scratch].abs().sum() > 0 and plain.kv_cache[:, :, scratch].abs().sum() == 0


def test_steps_the_graphs_cannot_take_run_eagerly():
    r = runner()
    r.use_cuda_graphs(4, capture=False)
    blocks = BlockManager(r.num_blocks, r.block_size)
    kvs = [KVState() for _ in range(6)]
    for kv in kvs:
        blocks.allocate(kv, 10)
    r.run([Chunk(list(range(9)), 0, kv.block_table) for kv in kvs])
    host_steps = []
    r.graphs.run = lambda host: host_steps.append(host)
    too_many = r.run([Chunk([1], 9, kv.block_table) for kv in kvs])  # 6 rows > the largest bucket (4)
    verifying = r.run([Chunk([1], 9, kvs[0].block_table, 1), Chunk([1, 2], 8, kvs[1].block_table, 2)])
    assert host_steps == [] and too_many.logits.shape[0] == 6 and verifying.logits.shape[0] == 3


def test_bad_chunks_are_refused_before_the_graph_path():
    r = runner()
    r.use_cuda_graphs(4, capture=False)
    with pytest.raises(ValueError, match="exceeds max_model_len=160"):
        r.run([Chunk([1], 160, list(range(41)))])
    with pytest.raises(ValueError, match="block table holds 4 slots, chunk needs 5"):
        r.run([Chunk([1], 4, [0])])


def test_a_dry_run_writes_only_the_scratch_block():
    """The capture's warm-up and the KV budget's graph estimate run the largest bucket on padding rows alone."""
    r = runner()
    r.use_cuda_graphs(16, capture=False)
    greedy(r, prompts(3), steps=2)
    before = r.kv_cache.clone()
    with torch.inference_mode():
        hidden = r.graphs.dry_run()
    scratch = r.scratch_block
    assert hidden.shape[0] == 16 and bool(hidden.isfinite().all())
    assert torch.equal(r.kv_cache[:, :, :scratch], before[:, :, :scratch])
