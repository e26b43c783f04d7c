"""The Triton backend: one paged kernel (triton_kernels.py) for decode, prefill, catch-up and verifying chunks,
reading the cache in place. CUDA's default; on a CPU it runs only under Triton's interpreter (tests)."""
from __future__ import annotations

import importlib.util
import os

import torch

from tokenrouter.models.attention.base import AttentionBackend
from tokenrouter.models.attention.metadata import AttentionMetadata


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonBackend(AttentionBackend):
    name = "triton"

    def captures(self, query_len: int) -> bool:
        return True  # the kernel's grid and scratch depend on host ints only (num_seqs, max_query_len)

    def check(self, device: str, block_size: int, dtype: str) -> str:
        if importlib.util.find_spec("triton") is None:
            return "needs the triton package (it comes with torch's CUDA builds; pip install triton)"
        if torch.device(device).type != "cuda" and not interpreted():
            return "runs on CUDA (or on a CPU under TRITON_INTERPRET=1, for tests)"
        return ""

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        from tokenrouter.models.attention.triton_kernels import paged_attention

        return paged_attention(q, k_cache, v_cache, torch.empty_like(q), meta.query_start_loc, meta.seq_lens,
                               meta.block_tables, scale, num_seqs=meta.num_seqs, max_query_len=meta.max_query_len)
