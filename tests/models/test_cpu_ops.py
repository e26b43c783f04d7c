"""The CPU ops (tokenrouter/models/native.py, csrc/cpu_ops.cpp): each against torch's ops, paged attention against
the torch backend (decode rows, short and long chunks, GQA, fp32 and bf16 caches), a token attending the same in
any step, and a runner on them against one on torch's ops."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.models.runner_steps import steps
from tokenrouter.config import ModelSpec
from tokenrouter.engine.model_runner import ModelRunner
from tokenrouter.models import native
from tokenrouter.models.attention import CpuBackend, TorchBackend, choose_backend, store_kv
from tokenrouter.models.attention.metadata import AttentionMetadata
from tokenrouter.models.layers import RotaryEmbedding, apply_rotary
from tokenrouter.models.tiny import build_tiny_model_dir

MISSING = native.cpu_ops_missing()
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"the CPU ops cannot be built here: {MISSING}")


@pytest.fixture(scope="module")
def ops():
    # NOTE: the first build compiles for 20-40 s; later processes load it from ~/.cache/tokenrouter/native
    return native.cpu_ops()


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_norms_and_silu_match_torch(ops, rows):
    x, delta, w = randn(rows, 896, seed=1), randn(rows, 896, seed=2), randn(896, seed=3)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (896,), w, 1e-6), rtol=1e-6, atol=1e-6)
    total, normed = ops.add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, F.rms_norm(x + delta, (896,), w, 1e-6), rtol=1e-6, atol=1e-6)
    gate_up = randn(rows, 2 * 4864, seed=4) * 30  # SiLU far into both tails, where exp over- and underflows
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("width", [1, 7, 13])
def test_silu_mul_takes_a_row_s_last_columns_as_the_others(ops, width):
    """Columns past the last eight in a row go through the same eight-lane arithmetic, zero-padded: the same floats as
    those columns in a row of a multiple of eight; a NaN stays one."""
    gate_up = randn(3, 2 * 64, seed=6) * 30
    gate_up[1, 60] = float("nan")
    gate, up = gate_up.chunk(2, dim=-1)
    full = ops.silu_mul(gate_up)
    part = ops.silu_mul(torch.cat([gate[:, 64 - width:], up[:, 64 - width:]], dim=1))
    assert torch.equal(part.nan_to_num(7.0), full[:, 64 - width:].nan_to_num(7.0))
    assert full[1, 60].isnan() and not full[0].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_rotates_and_writes_as_torch_does(ops, dtype):
    n, hq, hkv, d, blocks, bs = 6, 8, 2, 64, 5, 4
    rotary = RotaryEmbedding(d, 128, 10000.0)
    qkv = randn(n, hq + 2 * hkv, d, seed=5)
    qk, v = qkv.split([hq + hkv, hkv], dim=1)
    rope = rotary(torch.tensor([0, 3, 17, 18, 90, 127]))
    slots = torch.tensor([0, 5, 6, 13, 2, 19])
    want = apply_rotary(qk, *rope)
    k_want, v_want = torch.zeros(blocks, bs, hkv, d, dtype=dtype), torch.zeros(blocks, bs, hkv, d, dtype=dtype)
    store_kv(k_want, v_want, want[:, hq:].to(dtype), v.to(dtype), slots)
    k_got, v_got = torch.zeros_like(k_want), torch.zeros_like(v_want)
    ops.rope_store_(qk, v, *rope, k_got, v_got, slots)
    torch.testing.assert_close(qkv[:, :hq + hkv], want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_got, k_want, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6)
    assert torch.equal(v_got, v_want)


def paged(query_lens: list[int], context_lens: list[int], bs: int, hkv: int, d: int, dtype, seed: int):
    """A pool with random keys and values, each sequence's blocks scattered over it, and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-c // bs) for c in context_lens)
    pool = 4 + sum(-(-c // bs) for c in context_lens)
    order = torch.randperm(pool, generator=g)
    tables, used = np.zeros((len(context_lens), width), np.int32), 0
    for i, c in enumerate(context_lens):
        k = -(-c // bs)
        tables[i, :k] = order[used:used + k].numpy()
        used += k
    k_cache = torch.randn(pool, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(pool, bs, hkv, d, generator=g).to(dtype)
    qlens, clens = np.array(query_lens), np.array(context_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long),
        query_start_loc=torch.from_numpy(np.concatenate(([0], np.cumsum(qlens))).astype(np.int32)),
        seq_lens=torch.from_numpy(clens.astype(np.int32)), block_tables=torch.from_numpy(tables),
        num_seqs=len(query_lens), max_query_len=int(qlens.max()), query_lens=qlens, context_lens=clens,
        block_tables_host=tables)
    return k_cache, v_cache, meta


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(14, 2, 64, 16), (12, 2, 128, 4), (4, 4, 20, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens,context_lens", [
    ([1, 1, 1], [1, 37, 300]),  # decode rows
    ([1, 5, 3, 1], [9, 64, 5, 1000]),  # decode rows beside verifying and catch-up chunks
    ([40, 1, 16, 17], [40, 77, 50, 90]),  # a prefill and chunks either side of 16 (the longest until 2026-12-07)
])
def test_paged_attention_matches_the_torch_backend(query_lens, context_lens, dtype, heads, kv_heads, head_dim,
                                                  block_size):
    """Both of the kernel's paths: head_dim a multiple of 64 (8 keys a register, values in registers) with blocks
    of 16 and of 4 (groups of keys across blocks), and any other head_dim (plain loops)."""
    hq, hkv, d, bs = heads, kv_heads, head_dim, block_size
    k_cache, v_cache, meta = paged(query_lens, context_lens, bs, hkv, d, dtype, seed=sum(context_lens))
    q = randn(sum(query_lens), hq, d, seed=7)
    outs = []
    for backend in (TorchBackend(), CpuBackend()):
        assert not backend.check("cpu", bs, "float32")
        backend.prepare(meta, bs)
        outs.append(backend.forward(q, k_cache, v_cache, meta, d ** -0.5))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length", [5, 40])  # a verifying chunk; a prefill holding a sequence's first drafts
def test_a_token_attends_the_same_in_a_verifying_chunk_as_decoded_alone(length):
    """The verifying step's last token and the same token in a decode step: the same floats, so verification
    never disagrees with decoding over rounding."""
    hq, hkv, d, bs = 8, 2, 64, 16
    k_cache, v_cache, chunk = paged([length], [70], bs, hkv, d, torch.float32, seed=3)
    q = randn(length, hq, d, seed=8)
    decode = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), query_start_loc=torch.tensor([0, 1],
                               dtype=torch.int32), seq_lens=chunk.seq_lens, block_tables=chunk.block_tables, num_seqs=1,
                               max_query_len=1, query_lens=np.array([1]), context_lens=chunk.context_lens,
                               block_tables_host=chunk.block_tables_host)
    backend = CpuBackend()
    backend.check("cpu", bs, "float32")
    for meta in (chunk, decode):
        backend.prepare(meta, bs)
    together = backend.forward(q, k_cache, v_cache, chunk, d ** -0.5)
    alone = backend.forward(q[-1:], k_cache, v_cache, decode, d ** -0.5)
    assert torch.equal(together[-1:], alone)


def test_bad_metadata_is_refused_naming_the_field(ops):
    k_cache, v_cache, meta = paged([1], [20], 16, 2, 64, torch.float32, seed=1)
    q = randn(1, 8, 64)
    with pytest.raises(RuntimeError, match="beyond its block table"):
        ops.paged_attention_(torch.empty_like(q), q, k_cache, v_cache, meta.query_start_loc,
                             torch.tensor([33], dtype=torch.int32), meta.block_tables, 0.1, 16)
    with pytest.raises(RuntimeError, match="block_tables: chunk 0 names block 99"):
        ops.paged_attention_(torch.empty_like(q), q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                             torch.full_like(meta.block_tables, 99), 0.1, 16)
    with pytest.raises(RuntimeError, match="slots: token 0 writes slot -1"):
        qkv = randn(1, 12, 64)
        ops.rope_store_(qkv[:, :10], qkv[:, 10:], torch.ones(1, 1, 64), torch.zeros(1, 1, 64), k_cache, v_cache,
                        torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="q:"):
        ops.paged_attention_(torch.empty_like(q), q.double(), k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                             meta.block_tables, 0.1, 16)


def runner(source: str, backend: str, ops: bool) -> ModelRunner:
    spec = ModelSpec("m", f"tiny:{source}", block_size=4, num_kv_blocks=128, max_model_len=128,
                     attention_backend=backend)
    r = ModelRunner(spec, build_tiny_model_dir(source))
    if not ops:
        r.model.use_cpu_ops(None)
    return r


@pytest.mark.parametrize("source", ["qwen2-large", "qwen3", "llama"])
def test_a_runner_on_the_cpu_ops_matches_one_on_torch_s(source):
    plain, fused = runner(source, "torch", ops=False), runner(source, "auto", ops=True)
    assert fused.backend.name == "cpu" and fused.model.ops is not None
    for want, got in zip(steps(plain), steps(fused)):
        assert (got - want).abs().max().item() <= 1e-4


def test_auto_takes_torch_where_the_cpu_ops_are_turned_off(monkeypatch):
    monkeypatch.setenv("TOKENROUTER_NATIVE", "0")
    assert choose_backend("auto", "cpu", 16).name == "torch"
    with pytest.raises(ValueError, match="attention_backend='cpu'.*TOKENROUTER_NATIVE=0"):
        choose_backend("cpu", "cpu", 16)


def test_a_thread_keeps_its_own_thread_count_through_the_native_modules(ops):
    """A device thread set to one thread, then the caller restoring its own count (as placement.py does): the
    native modules' parallel loops run on the thread's count and leave it as it was (at::parallel_for reset it to
    the caller's, through each module's own copy of torch's lazy initialization)."""
    modules = [m for m in (ops, native.avx2()) if m is not None]
    set_one, restored, seen = threading.Event(), threading.Event(), []

    def device():
        torch.set_num_threads(1)
        torch.get_num_threads()
        set_one.set()
        restored.wait()
        ops.rms_norm(randn(1000, 896), torch.ones(896), 1e-6)
        seen.append(torch.get_num_threads())
        if len(modules) > 1:
            from tokenrouter.models.kernels import Int4Avx2
            from tokenrouter.models.quant import quantize_int4
            Int4Avx2(quantize_int4(randn(256, 512), 32), None)(randn(16, 512))
            seen.append(torch.get_num_threads())

    caller = torch.get_num_threads()
    thread = threading.Thread(target=device)
    thread.start()
    set_one.wait()
    torch.set_num_threads(max(2, caller))
    restored.set()
    thread.join()
    torch.set_num_threads(caller)
    assert seen == [1] * len(modules)
