"""Steps of every kind through a model runner, for comparing two runners' logits (attention backends, CPU ops)."""
from __future__ import annotations

import torch

from tokenrouter.engine.block_manager import BlockManager, KVState
from tokenrouter.engine.model_runner import Chunk, ModelRunner
from tokenrouter.models.tiny import VOCAB_SIZE


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
