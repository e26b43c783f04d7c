"""The Triton paged-attention kernel (tokenrouter/models/attention/triton_kernels.py) against a dense float64
reference, on CPU under TRITON_INTERPRET=1 (set by tests/models/conftest.py). Sizes are small: the
interpreter runs every program in Python."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

try:
    from tokenrouter.models.attention import triton_kernels as tk
except ImportError:  # the attention package is still a module; load the file by path
    _path = Path(__file__).parents[2] / "tokenrouter/models/attention/triton_kernels.py"
    _spec = importlib.util.spec_from_file_location("triton_kernels", _path)
    tk = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(tk)

SENTINEL = 7.0


def make_batch(chunks, hq=2, hkv=1, d=16, block_size=4, dtype=torch.float32, spare_cols=2, seed=0, pad_rows=0):
    # chunks: [(qlen, seq_len)]; every sequence's blocks are shuffled through the cache, unused slots hold NaN,
    # and block-table entries past a sequence's blocks hold ids far outside the cache.
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / block_size) for _, s in chunks]
    num_blocks = sum(need) + 3
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    ids = torch.randperm(num_blocks, generator=g)
    width = max(need + [1]) + spare_cols
    tables = torch.randint(-10**6, 10**6, (len(chunks), width), generator=g, dtype=torch.int32)
    used = 0
    for b, (_, seq_len) in enumerate(chunks):
        tables[b, :need[b]] = ids[used:used + need[b]].int()
        used += need[b]
        for p in range(seq_len):
            blk, off = tables[b, p // block_size], p % block_size
            k_cache[blk, off] = torch.randn(hkv, d, generator=g).to(dtype)
            v_cache[blk, off] = torch.randn(hkv, d, generator=g).to(dtype)
    qlens = torch.tensor([n for n, _ in chunks], dtype=torch.int32)
    qsl = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    qsl[1:] = qlens.cumsum(0)
    n = int(qsl[-1]) + pad_rows
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    seq_lens = torch.tensor([s for _, s in chunks], dtype=torch.int32)
    return q, k_cache, v_cache, qsl, seq_lens, tables


def reference(q, k_cache, v_cache, qsl, seq_lens, tables, scale):
    # dense causal attention per sequence in float64; rows of no sequence stay NaN
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    for b in range(len(seq_lens)):
        lo, hi, seq_len = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
        if hi == lo:
            continue
        blocks = tables[b, :math.ceil(seq_len / block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(group, 1)  # [S, Hq, D]
        v = v_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[lo:hi].double(), k) * scale
        qpos = seq_len - (hi - lo) + torch.arange(hi - lo)
        s = s.masked_fill(torch.arange(seq_len)[None, None, :] > qpos[None, :, None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def run(q, k_cache, v_cache, qsl, seq_lens, tables, num_splits=1):
    out = torch.full_like(q, SENTINEL)
    max_q = int((qsl[1:] - qsl[:-1]).max()) if len(seq_lens) else 0
    scale = q.shape[-1] ** -0.5
    got = tk.paged_attention(q, k_cache, v_cache, out, qsl, seq_lens, tables, scale,
                             num_seqs=len(seq_lens), max_query_len=max_q, num_splits=num_splits)
    assert got is out
    return out, reference(q, k_cache, v_cache, qsl, seq_lens, tables, scale)


def check(chunks, dtype=torch.float32, num_splits=1, **kw):
    out, ref = run(*make_batch(chunks, dtype=dtype, **kw), num_splits=num_splits)
    rows = ~ref.isnan().any(-1).any(-1)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out[rows].double(), ref[rows], **tol)
    assert (out[~rows] == SENTINEL).all()  # rows of no sequence are never written


@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_rows_of_different_lengths(block_size):
    check([(1, 1), (1, 5), (1, 17), (1, 40)], block_size=block_size)


@pytest.mark.parametrize("chunks", [[(7, 7)], [(20, 20), (3, 3)]])
def test_prefill(chunks):
    check(chunks, block_size=4)


@pytest.mark.parametrize("chunks", [[(5, 21)], [(16, 40), (2, 9)]])
def test_catch_up_over_a_cached_prefix(chunks):
    check(chunks, block_size=16)


@pytest.mark.parametrize("chunks", [[(3, 12), (9, 30), (5, 17)], [(4, 5)]])
def test_verifying_chunks(chunks):
    check(chunks, block_size=4)


@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch(block_size):
    check([(1, 9), (12, 12), (6, 33), (1, 1), (4, 20), (1, 64)], block_size=block_size, pad_rows=3)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (1, 1), (4, 2), (4, 1), (16, 2)])
def test_gqa_groups(hq, hkv):
    check([(1, 13), (5, 18), (3, 3)], hq=hq, hkv=hkv)


@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_lengths_at_block_boundaries(block_size):
    b = block_size
    check([(1, b - 1), (1, b), (1, b + 1), (2, 2 * b), (b, 2 * b + 1), (b + 1, b + 1)], block_size=block_size)


def test_block_larger_than_a_key_tile():
    check([(1, 300), (5, 260), (1, 3)], block_size=256, spare_cols=1)


@pytest.mark.parametrize("d", [16, 32, 64, 128, 80])
def test_head_dims(d):
    check([(1, 11), (4, 9)], d=d, block_size=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes(dtype):
    check([(1, 20), (6, 14)], dtype=dtype, hq=4, hkv=2)


@pytest.mark.parametrize("splits", [2, 3, 16])
def test_split_kv_decode(splits):
    # 16 splits over a 5-key sequence: most segments are empty and write a neutral partial
    check([(1, 5), (1, 70), (1, 33), (1, 1)], num_splits=splits, hq=4, hkv=2)


def test_split_kv_holds_for_chunks_too():
    check([(1, 40), (6, 37), (3, 3)], num_splits=3, block_size=16)


def test_empty_sequences_write_nothing():
    check([(0, 0), (1, 6), (0, 12), (3, 3), (0, 0)], pad_rows=2)
    check([(0, 0), (1, 6), (0, 12)], num_splits=4)


def test_result_ignores_garbage_in_unused_table_entries_and_cache_slots():
    # Capture safety (no host read, grid from host ints) is checked on the GPU in tests/gpu; here: the result is
    # a function of the used slots only, whatever fills the rest of the cache and the table.
    q, k_cache, v_cache, qsl, seq_lens, tables = make_batch([(1, 9), (4, 14)], block_size=4, spare_cols=3)
    first, _ = run(q, k_cache, v_cache, qsl, seq_lens, tables)
    used = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, s in enumerate(seq_lens.tolist()):
        for p in range(s):
            used[tables[b, p // 4], p % 4] = True
    k_cache[~used] = 1e4
    v_cache[~used] = -1e4
    tables[0, 3:] = 0
    tables[1, 4:] = tables[1, 0]
    second, _ = run(q, k_cache, v_cache, qsl, seq_lens, tables)
    assert torch.equal(first, second) and not first.isnan().any()


def test_splits_chosen_from_host_values_only(monkeypatch):
    assert tk.choose_splits(torch.device("cpu"), 1, 1, 1) == 1
    monkeypatch.setattr(tk, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    assert tk.choose_splits(cuda, 1, 8, 1) == tk.MAX_SPLITS
    assert tk.choose_splits(cuda, 4, 8, 1) == 9
    assert tk.choose_splits(cuda, 64, 8, 1) == 1
    assert tk.choose_splits(cuda, 1, 8, 2) == 1
