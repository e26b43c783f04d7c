"""The torch backend, for any device: gathers each chunk's context into dense tensors and attends with matmul
(decode rows, as one padded batch) or scaled_dot_product_attention (multi-token chunks). The CPU's backend where
the C++ one (cpu_backend.py) cannot be built; on a GPU the Triton kernel reads the cache in place instead. A
token's floats here depend on the step it is in (a chunk's matmuls against a decode row's).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tokenrouter.models.attention.base import AttentionBackend
from tokenrouter.models.attention.metadata import AttentionMetadata


DENSE_SCORES = 1 << 22  # a chunk attends with one score matrix up to this many entries (16 MiB in fp32)


class TorchBackend(AttentionBackend):
    name = "torch"

    def captures(self, query_len: int) -> bool:
        # NOTE: a decode-only step derives its gather slots from the device tensors alone (prepare), so it can be
        # captured; its width is then the graph's block-table width (max_model_len), which is slow but correct.
        # Multi-token chunks gather their contexts by the host's copy of the block tables.
        return query_len == 1

    def check(self, device: str, block_size: int, dtype: str) -> str:
        return ""

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        ext: dict = {"decode_rows": None, "decode_slots": None, "decode_mask": None, "context_blocks": None}
        meta.extra = ext
        device = meta.block_tables.device
        if meta.decode_only:
            tables, lens = meta.block_tables, meta.seq_lens
        else:
            rows = np.flatnonzero(meta.query_lens == 1)
            if rows.size:
                starts = meta.query_start_loc[:-1]
                index = torch.from_numpy(rows).to(device)
                ext["decode_rows"] = starts.index_select(0, index).long()
                tables, lens = meta.block_tables.index_select(0, index), meta.seq_lens.index_select(0, index)
            prepare_chunks(meta, block_size)
            if not rows.size:
                return
        # [B, W] blocks -> [B, W * block_size] slots of each decode row's context, masked past its length
        slots = (tables.long()[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
        host = meta.context_lens
        if host is not None:  # eager: trim to the longest decode context and skip the mask when all are equal
            decode_lens = host if meta.decode_only else host[meta.query_lens == 1]
            slots = slots[:, :int(decode_lens.max())]
            if decode_lens.min() == decode_lens.max():
                ext["decode_slots"] = slots
                return
        ext["decode_slots"] = slots
        ext["decode_mask"] = torch.arange(slots.shape[1], device=device)[None, :] < lens[:, None]

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        # q: [N, Hq, D] -> [N, Hq, D]; each chunk attends to its own context, no padding across chunks but
        # for the single-token (decode) chunks, which attend as one padded batch.
        # NOTE: on CPU, half-precision bmm and softmax run far slower than float32, so a bf16 model attends in
        # float32 (the gathered context is small next to the weights).
        ext, dtype = meta.extra, q.dtype
        compute = torch.float32 if q.device.type == "cpu" else dtype
        q = (q if dtype == compute else q.to(compute)) * scale
        if meta.decode_only:
            out = _attend_decode(q, k_cache, v_cache, ext["decode_slots"], ext["decode_mask"], compute)
            return out if out.dtype == dtype else out.to(dtype)
        out = torch.empty_like(q)
        rows = ext["decode_rows"]
        if rows is not None:
            out[rows] = _attend_decode(q[rows], k_cache, v_cache, ext["decode_slots"], ext["decode_mask"], compute)
        attend_chunks(q, k_cache, v_cache, meta, out)
        return out if out.dtype == dtype else out.to(dtype)


def prepare_chunks(meta: AttentionMetadata, block_size: int) -> None:
    """The context blocks of the chunks of more than one token, gathered in one op by attend_chunks."""
    chunks = np.flatnonzero(meta.query_lens > 1)
    blocks = [meta.block_tables_host[i, :-(-meta.context_lens[i] // block_size)] for i in chunks]
    meta.extra["context_starts"] = np.concatenate(([0], np.cumsum([len(b) for b in blocks]) * block_size))
    context_blocks = torch.from_numpy(np.concatenate(blocks).astype(np.int64))
    meta.extra["context_blocks"] = context_blocks.to(meta.block_tables.device)


def attend_chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  out: torch.Tensor) -> None:
    """Attention of the chunks of more than one token (prepare_chunks), each over its own gathered
    context, into their rows of `out`; q (scaled) and out in the compute dtype."""
    ext = meta.extra
    k = k_cache.index_select(0, ext["context_blocks"]).flatten(0, 1)  # [blocks * bs, Hkv, D]
    v = v_cache.index_select(0, ext["context_blocks"]).flatten(0, 1)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    start, chunk = 0, 0
    for n, ctx in zip(meta.query_lens.tolist(), meta.context_lens.tolist()):
        if n > 1:
            first = ext["context_starts"][chunk]
            out[start:start + n] = _attend_chunk(q[start:start + n], k[first:first + ctx], v[first:first + ctx])
            chunk += 1
        start += n


def _attend_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   mask: torch.Tensor | None, compute: torch.dtype) -> torch.Tensor:
    # q: [B, Hq, D]; slots, mask: [B, L] -> [B, Hq, D]
    # NOTE: the query heads sharing a kv head attend as the rows of one matrix, so GQA never repeats the keys.
    b, hq, d = q.shape
    hkv = k_cache.shape[-2]
    slots = slots.flatten()
    keys = k_cache.view(-1, hkv, d).index_select(0, slots).view(b, -1, hkv, d)
    values = v_cache.view(-1, hkv, d).index_select(0, slots).view(b, -1, hkv, d)
    if keys.dtype != compute:
        keys, values = keys.to(compute), values.to(compute)
    scores = torch.matmul(q.view(b, hkv, hq // hkv, d), keys.permute(0, 2, 3, 1))  # [B, Hkv, G, L]
    if mask is not None:
        scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1)
    return torch.matmul(probs, values.transpose(1, 2)).view(b, hq, d)  # [B, Hkv, G, D] -> [B, Hq, D]


def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q: [n, Hq, D]; k, v: [ctx, Hkv, D], the last n of them the chunk's own -> [n, Hq, D]
    # new token j sees the cached keys and the new keys up to j
    n, hq, d = q.shape
    ctx, hkv = k.shape[0], k.shape[1]
    if hq * n * ctx > DENSE_SCORES:  # long prompts: SDPA's kernel never holds the whole score matrix
        mask = None if n == ctx else causal_mask(n, ctx, q.device)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                             is_causal=n == ctx, scale=1.0, enable_gqa=True)
        return out.transpose(0, 1)
    # NOTE: as in _attend_decode, the query heads of a kv head are the rows of one matrix (no repeated keys); on a
    # CPU this is 1.4-2.5x faster than SDPA for chunks this small (2026-12-04, AMD EPYC, 2 cores)
    g = hq // hkv
    qg = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * n, d)  # [Hkv, G * n, D]
    scores = torch.matmul(qg, k.permute(1, 2, 0)).view(hkv, g, n, ctx)
    scores.masked_fill_(~causal_mask(n, ctx, q.device), float("-inf"))
    out = torch.matmul(scores.softmax(-1).view(hkv, g * n, ctx), v.transpose(0, 1))  # [Hkv, G * n, D]
    return out.view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


def causal_mask(n: int, ctx: int, device: torch.device) -> torch.Tensor:
    # [n, ctx]: True where new token j (at position ctx - n + j) may see key i
    return torch.arange(ctx, device=device)[None, :] <= torch.arange(ctx - n, ctx, device=device)[:, None]
