"""The Triton backend inside the model runner (on CPU under TRITON_INTERPRET=1, tests/conftest.py) against the
torch backend: prefill, catch-up and verifying chunks, mixed steps, decode, and the decode-graph stand-in."""
from __future__ import annotations

import pytest
import torch

from tokenrouter.config import ModelSpec
from tokenrouter.engine.block_manager import BlockManager, KVState
from tokenrouter.engine.model_runner import Chunk, ModelRunner
from tokenrouter.models.tiny import VOCAB_SIZE, build_tiny_model_dir

pytest.importorskip("triton")


def runner(source: str, backend: str, block_size: int = 4) -> ModelRunner:
    spec = ModelSpec("m", f"tiny:{source}", block_size=block_size, num_kv_blocks=128, max_model_len=128,
                     attention_backend=backend)
    return ModelRunner(spec, build_tiny_model_dir(source))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def steps(r: ModelRunner) -> list[torch.Tensor]:
    """A prefill, a mixed step (catch-up with outputs at every position, a verifying chunk, decode rows) and a
    decode step over three sequences; the logits of each."""
    blocks = BlockManager(r.num_blocks, r.block_size)
    seqs = [tokens(n, seed=n) for n in (11, 6, 23)]
    kvs = [KVState() for _ in seqs]
    for kv, s in zip(kvs, seqs):
        blocks.allocate(kv, len(s) + 8)
    out = [r.run([Chunk(s[:-4], 0, kv.block_table, 2) for kv, s in zip(kvs, seqs)]).logits]
    out.append(r.run([Chunk(seqs[0][-4:], len(seqs[0]) - 4, kvs[0].block_table, 4),
                      Chunk(seqs[1][-4:-3], len(seqs[1]) - 4, kvs[1].block_table),
                      Chunk(seqs[2][-4:], len(seqs[2]) - 4, kvs[2].block_table, 3)]).logits)
    out.append(r.run([Chunk([7], len(s), kv.block_table) for kv, s in zip(kvs, seqs)]).logits)
    return out


@pytest.mark.parametrize("source,block_size", [("qwen2-large", 4), ("qwen3", 16), ("llama", 4)])
def test_triton_backend_matches_the_torch_backend_in_the_runner(source, block_size):
    plain, triton = runner(source, "torch", block_size), runner(source, "triton", block_size)
    assert triton.backend.name == "triton"
    for want, got in zip(steps(plain), steps(triton)):
        assert (got - want).abs().max().item() <= 1e-4


def test_triton_backend_under_the_graph_stand_in():
    plain, graphed = runner("qwen2-large", "torch"), runner("qwen2-large", "triton")
    graphed.use_cuda_graphs(4, capture=False)
    for want, got in zip(steps(plain), steps(graphed)):  # the last step: 3 decode rows padded to a bucket of 4
        assert (got - want).abs().max().item() <= 1e-4
