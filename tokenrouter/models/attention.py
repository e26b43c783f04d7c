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
    context_blocks: torch.Tensor | None = None  # [total blocks] the blocks of every chunk's context (torch backend)
    context_starts: list[int] | None = None  # row of chunk i's first key in the gathered blocks; -1: a decode row
    decode_rows: torch.Tensor | None = None  # [B] token rows of the single-token chunks (None: every row)
    decode_slots: torch.Tensor | None = None  # [B, L] cache slots of each decode row's context, padded
    decode_mask: torch.Tensor | None = None  # [B, L] True where the slot is real context (None: no padding)
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32 (flash backend)
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None


def flash_available(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None


def choose_backend(requested: str, device: str, block_size: int, dtype: str = "bfloat16") -> str:
    if requested == "torch":
        return "torch"
    if requested == "flash":
        if dtype == "float32":
            raise ValueError("attention_backend='flash': flash-attn computes in float16 or bfloat16; "
                             "set dtype: bfloat16 (or attention_backend: torch for float32)")
        if not flash_available(device):
            raise ValueError("attention_backend='flash' needs a CUDA device and the flash-attn package "
                             "(pip install 'tokenrouter[cuda]')")
        if block_size % 256:
            raise ValueError(f"attention_backend='flash' needs block_size divisible by 256, got {block_size}")
        return "flash"
    return "flash" if flash_available(device) and block_size % 256 == 0 and dtype != "float32" else "torch"


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k, v: [N, Hkv, D] written to cache slots slot_mapping: [N]
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def torch_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    # q: [N, Hq, D] -> [N, Hq, D]; each chunk attends to its own context, no padding across chunks but
    # for the single-token (decode) chunks, which attend as one padded batch.
    # NOTE: on CPU, half-precision bmm and softmax run far slower than float32, so a bf16 model attends in
    # float32 (the gathered context is small next to the weights).
    dtype = q.dtype
    compute = torch.float32 if q.device.type == "cpu" else dtype
    q = q.to(compute) * scale
    rows = meta.decode_rows
    if meta.decode_slots is not None and rows is None:  # every row decodes
        out = _attend_decode(q, k_cache, v_cache, meta.decode_slots, meta.decode_mask, compute)
        return out if out.dtype == dtype else out.to(dtype)
    out = torch.empty_like(q)
    if meta.decode_slots is not None:
        out[rows] = _attend_decode(q[rows], k_cache, v_cache, meta.decode_slots, meta.decode_mask, compute)
    if meta.context_blocks.numel():
        k = k_cache.index_select(0, meta.context_blocks).flatten(0, 1).to(compute)  # [blocks * block_size, Hkv, D]
        v = v_cache.index_select(0, meta.context_blocks).flatten(0, 1).to(compute)
        start = 0
        for n, ctx, first in zip(meta.query_lens, meta.context_lens, meta.context_starts):
            if n > 1:
                out[start:start + n] = _attend_chunk(q[start:start + n], k[first:first + ctx], v[first:first + ctx])
            start += n
    return out.to(dtype)


def _attend_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   mask: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    # q: [B, Hq, D]; slots, mask: [B, L] -> [B, Hq, D]
    # NOTE: the query heads sharing a kv head attend as the rows of one matrix, so GQA never repeats the keys.
    b, hq, d = q.shape
    hkv = k_cache.shape[-2]
    keys = k_cache.view(-1, hkv, d).index_select(0, slots.flatten()).view(b, -1, hkv, d).to(compute)
    values = v_cache.view(-1, hkv, d).index_select(0, slots.flatten()).view(b, -1, hkv, d).to(compute)
    scores = torch.matmul(q.view(b, hkv, hq // hkv, d), keys.permute(0, 2, 3, 1))  # [B, Hkv, G, L]
    if mask is not None:
        scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1)
    return torch.matmul(probs, values.transpose(1, 2)).view(b, hq, d)  # [B, Hkv, G, D] -> [B, Hq, D]


def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q: [n, Hq, D]; k, v: [ctx, Hkv, D], the last n of them the chunk's own -> [n, Hq, D]
    n, ctx = q.shape[0], k.shape[0]
    mask = None
    if n < ctx:  # a catch-up chunk: new token j sees cached keys and new keys up to j
        mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - n, ctx, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         is_causal=n == ctx, scale=1.0, enable_gqa=True)
    return out.transpose(0, 1)


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
