"""Attention over a paged KV cache: a torch backend for any device, flash-attn on CUDA when installed.

The cache of one layer is `[num_blocks, block_size, num_kv_heads, head_dim]`; a token's slot is
`block_table[pos // block_size] * block_size + pos % block_size`. Both backends read the same layout.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one batch of chunks: chunk i computes `query_lens[i]` new tokens whose keys join the
    `context_lens[i] - query_lens[i]` already cached ones."""
    slot_mapping: torch.Tensor  # [N] cache slot of each new token
    query_lens: list[int]
    context_lens: list[int]
    context_slots: list[torch.Tensor]  # per chunk, [context_len] slots of its whole context (torch backend)
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32 (flash backend)
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None


def flash_available(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def choose_backend(requested: str, device: str, block_size: int) -> str:
    if requested == "torch":
        return "torch"
    if requested == "flash":
        if not flash_available(device):
            raise ValueError("attention_backend='flash' needs a CUDA device and the flash-attn package "
                             "(pip install 'tokenrouter[cuda]')")
        if block_size % 256:
            raise ValueError(f"attention_backend='flash' needs block_size divisible by 256, got {block_size}")
        return "flash"
    return "flash" if flash_available(device) and block_size % 256 == 0 else "torch"


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k, v: [N, Hkv, D] written to cache slots slot_mapping: [N]
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def torch_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    # q: [N, Hq, D] -> [N, Hq, D]; each chunk attends to its own context, no padding across chunks.
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    out = torch.empty_like(q)
    start = 0
    for n, ctx, slots in zip(meta.query_lens, meta.context_lens, meta.context_slots):
        qi = q[start:start + n].transpose(0, 1)  # [Hq, n, D]
        ki = k_flat[slots].transpose(0, 1)  # [Hkv, ctx, D]
        vi = v_flat[slots].transpose(0, 1)
        mask = None
        if 1 < n < ctx:  # a catch-up chunk: new token j sees cached keys and new keys up to j
            mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - n, ctx, device=q.device)[:, None]
        oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=(n > 1 and n == ctx),
                                            scale=scale, enable_gqa=True)
        out[start:start + n] = oi.transpose(0, 1)
        start += n
    return out


def flash_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    if max(meta.query_lens) == 1:
        cache_seqlens = meta.cu_seqlens_k.diff().to(torch.int32)
        out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=cache_seqlens,
                                      block_table=meta.block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1)
    return flash_attn_varlen_func(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k,
                                  max(meta.query_lens), max(meta.context_lens), softmax_scale=scale,
                                  causal=True, block_table=meta.block_tables)


BACKENDS = {"torch": torch_attention, "flash": flash_attention}
