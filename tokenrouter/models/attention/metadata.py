"""What every attention backend reads about one step: the common tensors, built once per step.

A step is a batch of chunks: chunk i computes `query_lens[i]` new tokens whose keys join the
`seq_lens[i] - query_lens[i]` already cached ones; query token j of chunk i sits at position
`seq_lens[i] - query_lens[i] + j` and sees keys 0 .. that position. A token's cache slot is
`block_tables[i, pos // block_size] * block_size + pos % block_size`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] int64, cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32, row of chunk i's first token; [B] = N
    seq_lens: torch.Tensor  # [B] int32, context length of chunk i once its tokens are in
    block_tables: torch.Tensor  # [B, W] int32, W = the longest context's blocks (a graph's: max_model_len's)
    num_seqs: int
    max_query_len: int  # host ints: fixed for a captured graph, so kernels may size their grid by them
    # host copies (numpy) for backends that loop over chunks on the host (torch's chunk path); None in a graph
    query_lens: np.ndarray | None = None  # [B]
    context_lens: np.ndarray | None = None  # [B] = seq_lens
    block_tables_host: np.ndarray | None = None  # [B, W]
    extra: dict | None = None  # what one backend derives for itself (AttentionBackend.prepare)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k, v: [N, Hkv, D] written to cache slots slot_mapping: [N]
    # NOTE: padded rows of a graph step write to the pool's scratch block, which no sequence owns
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)
