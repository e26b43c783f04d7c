"""The interface every attention backend implements."""
from __future__ import annotations

import torch

from tokenrouter.models.attention.metadata import AttentionMetadata


class AttentionBackend:
    name = ""

    def captures(self, query_len: int) -> bool:
        """Whether a step whose every row carries `query_len` new tokens reads no host metadata (no .item(), no
        host lists, no value-dependent shapes) in prepare and forward, so tokenrouter/engine/cuda_graphs.py may
        capture it."""
        return False

    def check(self, device: str, block_size: int, dtype: str) -> str:
        """Why this backend cannot run here ("" when it can)."""
        raise NotImplementedError

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Derive what this backend needs beyond the common metadata, once per step (before the layers)."""

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        # q: [N, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] -> [N, Hq, D]
        raise NotImplementedError
