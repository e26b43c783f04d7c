"""Paged attention in one Triton kernel for decode, prefill, catch-up and verifying chunks.

A program owns one query block of one sequence (BLOCK_Q query tokens) for one kv head and every query head
that shares it, flattened into the M rows of its tiles, and walks the sequence's keys in tiles of TILE
tokens, finding each key's physical block through the block table. With num_splits > 1 the keys of each
program are cut into segments computed by separate programs and merged by a second small kernel.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

TILE = 32
MAX_SPLITS = 16
LOG2E = 1.4426950408889634


@triton.jit
def _attend(q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, mx_ptr, sm_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
            qk_scale, q_blocks, hq,
            sq_n, sq_h, so_n, so_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sbt,
            BLOCK_SIZE: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
            BLOCK_M: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr,
            NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    seq = tl.program_id(0) // q_blocks
    q_block = tl.program_id(0) % q_blocks
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_first = tl.load(qsl_ptr + seq)
    qlen = tl.load(qsl_ptr + seq + 1) - q_first
    seq_len = tl.load(seq_lens_ptr + seq)
    if q_block * BLOCK_Q >= qlen:  # an idle program: this sequence's chunk is shorter than max_query_len
        return
    ctx = tl.maximum(seq_len - qlen, 0)  # keys cached before the chunk

    rows = tl.arange(0, BLOCK_M)
    qi = q_block * BLOCK_Q + rows // G_PAD  # [M] query index within the chunk
    g = rows % G_PAD
    row_ok = (rows // G_PAD < BLOCK_Q) & (qi < qlen) & (g < G)
    tok = (q_first + qi).to(tl.int64)
    head = kvh * G + g
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok[:, None] * sq_n + head[:, None] * sq_h + d[None, :], mask=io_mask, other=0.0)
    # q: [M, D_PAD]; row r may see keys 0 .. ctx + qi[r]
    if UPCAST:
        q = q.to(tl.float32)
    limit = ctx + qi

    kv_end = tl.minimum(ctx + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, qlen), seq_len)
    num_tiles = (kv_end + TILE - 1) // TILE
    per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for t in range(tile_lo, tile_hi):
        kpos = t * TILE + tl.arange(0, TILE)  # [TILE]
        k_ok = kpos < kv_end
        # NOTE: entries past a sequence's length may be garbage ids, so the table is read only under k_ok.
        blk = tl.load(bt_ptr + seq * sbt + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        off = (kpos % BLOCK_SIZE).to(tl.int64)
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + blk[:, None] * sk_b + off[:, None] * sk_s + kvh * sk_h + d[None, :],
                    mask=kv_mask, other=0.0)  # [TILE, D_PAD]
        v = tl.load(v_ptr + blk[:, None] * sv_b + off[:, None] * sv_s + kvh * sv_h + d[None, :],
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, TILE], log2 units
        s = tl.where(k_ok[None, :] & (kpos[None, :] <= limit[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # NOTE: a row with no visible key yet keeps m = -inf; shifting by 0 instead keeps exp2 free of NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tok[:, None] * so_n + head[:, None] * so_h + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # part: [N, Hq, NUM_SPLITS, D_PAD] unnormalised; mx, sm: [N, Hq, NUM_SPLITS] (an empty segment: -inf, 0)
        row = (tok * hq + head) * NUM_SPLITS + split
        tl.store(part_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(mx_ptr + row, m_i, mask=row_ok)
        tl.store(sm_ptr + row, l_i, mask=row_ok)


@triton.jit
def _combine(part_ptr, mx_ptr, sm_ptr, out_ptr, qsl_ptr, so_n, so_h, hq, max_q,
             D: tl.constexpr, D_PAD: tl.constexpr,
             NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr):
    seq = tl.program_id(0) // max_q
    qi = tl.program_id(0) % max_q
    head = tl.program_id(1)
    q_first = tl.load(qsl_ptr + seq)
    if qi >= tl.load(qsl_ptr + seq + 1) - q_first:
        return
    tok = (q_first + qi).to(tl.int64)
    s = tl.arange(0, S_PAD)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, D_PAD)
    row = (tok * hq + head) * NUM_SPLITS + s  # [S_PAD]
    mx = tl.load(mx_ptr + row, mask=s_ok, other=float("-inf"))
    sm = tl.load(sm_ptr + row, mask=s_ok, other=0.0)
    part = tl.load(part_ptr + row[:, None] * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0)  # [S_PAD, D_PAD]
    top = tl.max(mx, 0)
    w = tl.where(mx == float("-inf"), 0.0, tl.exp2(mx - tl.where(top == float("-inf"), 0.0, top)))
    total = tl.sum(w * sm, 0)
    o = tl.sum(w[:, None] * part, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + tok * so_n + head * so_h + d, o.to(out_ptr.dtype.element_ty), mask=d < D)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(device: torch.device, num_seqs: int, num_kv_heads: int, max_query_len: int) -> int:
    # Decode at small batch leaves most SMs idle; split each sequence's keys to reach ~2 programs per SM.
    if max_query_len != 1 or device.type != "cuda" or num_seqs == 0:
        return 1
    programs = num_seqs * num_kv_heads
    return max(1, min(MAX_SPLITS, triton.cdiv(2 * _sm_count(device), programs)))


def paged_attention(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale: float, *,
                    num_seqs: int, max_query_len: int, num_splits: int | None = None) -> torch.Tensor:
    # q: [N, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; out: [N, Hq, D] (written, returned)
    # query_start_loc: int32 [num_seqs + 1]; seq_lens: int32 [num_seqs]; block_tables: int32 [num_seqs, W]
    # NOTE: capture-safe: the grid and every allocation depend on host ints and shapes only, never on tensor values.
    n, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    if num_seqs == 0 or max_query_len == 0 or n == 0:
        return out
    assert hq % hkv == 0 and k_cache.stride(3) == v_cache.stride(3) == q.stride(2) == out.stride(2) == 1
    splits = max(1, num_splits) if num_splits else choose_splits(q.device, num_seqs, hkv, max_query_len)
    group = hq // hkv
    g_pad = triton.next_power_of_2(group)
    block_q = 1 if max_query_len == 1 else max(1, min(triton.next_power_of_2(max_query_len), 64 // g_pad))
    block_m = max(16, block_q * g_pad)  # NOTE: tl.dot on a GPU needs M >= 16; extra rows are masked
    d_pad = max(16, triton.next_power_of_2(d))
    q_blocks = triton.cdiv(max_query_len, block_q)
    if splits > 1:
        # Scratch sized from host ints; under graph capture this allocation comes from the graph's pool.
        part = torch.empty(n, hq, splits, d_pad, dtype=torch.float32, device=q.device)  # [N, Hq, S, D_PAD]
        mx = torch.empty(n, hq, splits, dtype=torch.float32, device=q.device)  # [N, Hq, S]
        sm = torch.empty_like(mx)
    else:
        part = mx = sm = out
    # NOTE: Triton's interpreter multiplies bfloat16 in tl.dot as its raw uint16 bits, so on CPU it gets fp32.
    upcast = q.dtype == torch.bfloat16 and q.device.type == "cpu"
    precision = "ieee" if q.dtype == torch.float32 else None  # NOTE: fp32 must not drop to tf32 on a GPU
    _attend[(num_seqs * q_blocks, hkv, splits)](
        q, k_cache, v_cache, out, part, mx, sm, query_start_loc, seq_lens, block_tables,
        scale * LOG2E, q_blocks, hq,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=block_size, G=group, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_M=block_m, D=d, D_PAD=d_pad,
        TILE=TILE, NUM_SPLITS=splits, PRECISION=precision, UPCAST=upcast)
    if splits > 1:
        _combine[(num_seqs * max_query_len, hq)](
            part, mx, sm, out, query_start_loc, out.stride(0), out.stride(1), hq, max_query_len,
            D=d, D_PAD=d_pad, NUM_SPLITS=splits,
            S_PAD=triton.next_power_of_2(splits))
    return out
