"""flash-attn's paged kernels (CUDA, fp16/bf16, block_size a multiple of 256), when installed and asked for."""
from __future__ import annotations

import importlib.util

import torch

from tokenrouter.models.attention.base import AttentionBackend
from tokenrouter.models.attention.metadata import AttentionMetadata


class FlashBackend(AttentionBackend):
    name = "flash"

    def captures(self, query_len: int) -> bool:
        return query_len == 1  # a decode step reads only device tensors (flash_attn_with_kvcache)

    def check(self, device: str, block_size: int, dtype: str) -> str:
        if dtype == "float32":
            return "flash-attn computes in float16 or bfloat16; set dtype: bfloat16 (or attention_backend: torch)"
        if torch.device(device).type != "cuda" or importlib.util.find_spec("flash_attn") is None:
            return "needs a CUDA device and the flash-attn package (pip install 'tokenrouter[cuda]')"
        if block_size % 256:
            return f"needs block_size divisible by 256, got {block_size}"
        return ""

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        if not meta.decode_only:
            cu_seqlens_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=meta.seq_lens.device)
            torch.cumsum(meta.seq_lens, 0, out=cu_seqlens_k[1:])
            meta.extra = {"cu_seqlens_k": cu_seqlens_k, "max_seqlen_k": int(meta.context_lens.max())}

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        if meta.decode_only:
            out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                          block_table=meta.block_tables, softmax_scale=scale, causal=True)
            return out.squeeze(1)
        return flash_attn_varlen_func(q, k_cache, v_cache, meta.query_start_loc, meta.extra["cu_seqlens_k"],
                                      meta.max_query_len, meta.extra["max_seqlen_k"], softmax_scale=scale,
                                      causal=True, block_table=meta.block_tables)
