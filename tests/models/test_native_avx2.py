"""The AVX2 kernels (tokenrouter/models/native.py, csrc/avx2_gemm.cpp): built where the machine can, equal to a
float64 reference of their arithmetic (and to int4-vnni's, int4-vnni-a8's and int8-vnni's, bit for bit), and
independent of the batch a row shares."""
from __future__ import annotations

import json

import pytest
import torch

from tokenrouter.config import ModelSpec
from tokenrouter.engine.model_runner import ModelRunner
from tokenrouter.models import native
from tokenrouter.models.kernels import (Int4Avx2, Int4Avx2A8, Int4Vnni, Int4VnniA8, Int8Avx2, Int8Vnni,
                                        KernelChoice,
                                        candidates)
from tokenrouter.models.quant import Int8Weight, quantize_int4, quantize_int8
from tokenrouter.models.tiny import VOCAB_SIZE, build_tiny_model_dir

MISSING = native.avx2_missing()
needs_avx2 = pytest.mark.skipif(bool(MISSING), reason=f"the AVX2 kernels cannot be built here: {MISSING}")
ROWS = range(1, 18)  # every split of the kernels' row passes (up to 6 rows a pass)


@pytest.fixture(scope="module", autouse=True)
def built():
    # NOTE: the first build compiles for 30-60 s; later processes load it from ~/.cache/tokenrouter/native
    return native.avx2()


def test_it_is_built_wherever_nothing_is_missing():
    assert (native.avx2() is not None) == (not MISSING), MISSING


def test_it_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("TOKENROUTER_NATIVE", "0")
    assert native.avx2_missing() == "TOKENROUTER_NATIVE=0"


def two_digits(x: torch.Tensor, k_padded: int, digits: int = 2):
    """x [M, K] -> v [M, blocks, 32] (254 hi + lo; one digit: hi), xs and xsum [M, blocks]: the kernels' split,
    in fp32 as they take it (round half to even)."""
    x = torch.nn.functional.pad(x, (0, k_padded - x.shape[1])).reshape(x.shape[0], -1, 32)
    amax = x.abs().amax(-1, keepdim=True)
    t = x * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    hi = t.round()
    if digits == 1:
        return hi.double(), (amax[..., 0] / 127.0).double(), x.double().sum(-1)
    v = 254 * hi + ((t - hi) * 254).round()
    return v.double(), (amax[..., 0] / (127.0 * 254)).double(), x.double().sum(-1)


def int4_reference(x, q, bias, digits: int = 2):
    # y = sum_b scale * xs * sum_j code * v + low * sum_j x, with the kernel's fp16 scale and low
    n, k = q.codes.shape
    v, xs, xsum = two_digits(x, k, digits)
    codes = q.codes.double().reshape(n, k // 32, 32)
    scale, low = (t.half().double().repeat_interleave(q.group // 32, dim=1) for t in (q.scale, q.low))
    dots = torch.einsum("mbj,nbj->mnb", v, codes)
    return (dots * scale * xs[:, None]).sum(-1) + xsum @ low.T + bias.double()


def int8_reference(x, q, bias):
    n, k = q.codes.shape
    blocks = -(-k // 32)
    v, xs, _ = two_digits(x, 32 * blocks)
    codes = torch.nn.functional.pad(q.codes.double(), (0, 32 * blocks - k)).reshape(n, blocks, 32)
    dots = torch.einsum("mbj,nbj->mnb", v, codes)
    return (dots * xs[:, None]).sum(-1) * q.scale.double() + bias.double()


def relative(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def random_projection(n: int, k: int, seed: int) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return gen, torch.randn(n, k, generator=gen) * 0.02, torch.randn(n, generator=gen)


def rows_with_outliers(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=gen)
    x[0, 3], x[-1, -1] = 40.0, -25.0  # the rest of their blocks keep their precision through the low digit
    return x


@needs_avx2
@pytest.mark.parametrize("digits", [2, 1], ids=["int4-avx2", "int4-avx2-a8"])
@pytest.mark.parametrize("n, k, group", [(70, 96, 32), (36, 160, 32), (130, 256, 128), (64, 896, 64)])
def test_int4_equals_its_arithmetic_in_float64(n, k, group, digits):
    gen, w, bias = random_projection(n, k, n)
    q = quantize_int4(w, group)
    kernel = (Int4Avx2 if digits == 2 else Int4Avx2A8)(q, bias)
    for m in ROWS:
        x = rows_with_outliers(m, k, gen)
        # exact activations: > 1e-5 (two digits), > 1e-3 (one)
        assert relative(kernel(x), int4_reference(x, q, bias, digits)) < 5e-6, m


@needs_avx2
@pytest.mark.skipif(bool(native.vnni_missing()), reason="the VNNI kernels cannot be built here")
@pytest.mark.parametrize("pair", [(Int4Avx2, Int4Vnni), (Int4Avx2A8, Int4VnniA8)], ids=["two-digits", "one-digit"])
@pytest.mark.parametrize("n, k", [(70, 96), (132, 256), (38, 1536)])
def test_int4_gives_int4_vnni_s_floats(n, k, pair):
    # the same integers and the same fp32 operations in the same order: calibration's int4-vnni and int4-a8
    # records hold
    gen = torch.Generator().manual_seed(k)
    q, bias = quantize_int4(torch.randn(n, k, generator=gen), 32), torch.randn(n, generator=gen)
    ours, vnni = pair[0](q, bias), pair[1](q, bias)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen) * 3
        assert torch.equal(ours(x), vnni(x)), m


@needs_avx2
@pytest.mark.skipif(bool(native.vnni_missing()), reason="the VNNI kernels cannot be built here")
@pytest.mark.parametrize("n, k", [(70, 96), (37, 100), (16, 40), (38, 1536)])
def test_int8_gives_int8_vnni_s_floats(n, k):
    # the same integers and the same fp32 operations in the same order: calibration's int8 record holds for both
    assert_same_int8_floats(Int8Avx2, Int8Vnni, n, k)


def assert_same_int8_floats(ours: type, theirs: type, n: int, k: int) -> None:
    """Two int8 kernels give the same floats for every batch of ROWS, on codes with int8's extremes."""
    gen = torch.Generator().manual_seed(n * k)
    codes = quantize_int8(torch.randn(n, k, generator=gen)).codes.clone()
    codes[0, :5], codes[1, :] = -128, 127  # the products of -128 and +-32385 sum exactly too
    q, bias = Int8Weight(codes, torch.rand(n, generator=gen) + 0.1), torch.randn(n, generator=gen)
    a, b = ours(q, bias), theirs(q, bias)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen) * 3
        assert torch.equal(a(x), b(x)), m


@needs_avx2
@pytest.mark.parametrize("n, k", [(70, 96), (37, 100), (128, 40), (64, 896)])
def test_int8_equals_its_arithmetic_in_float64(n, k):
    gen, w, bias = random_projection(n, k, n + k)
    codes = quantize_int8(w).codes.clone()
    codes[0, :5], codes[1, :] = -128, 127  # the extremes of int8 (no quantizer here makes -128)
    q = Int8Weight(codes, quantize_int8(w).scale)
    kernel = Int8Avx2(q, bias)
    for m in ROWS:
        x = rows_with_outliers(m, k, gen)
        reference = int8_reference(x, q, bias)
        assert relative(kernel(x), reference) < 5e-6, m
        exact = x.double() @ (q.codes.double() * q.scale.double()[:, None]).T + bias.double()
        assert relative(kernel(x), exact) < 1e-4  # two digits: about 15 bits of each activation


@needs_avx2
@pytest.mark.parametrize("make", [lambda w: Int4Avx2(quantize_int4(w, 32), None),
                                  lambda w: Int4Avx2A8(quantize_int4(w, 32), None),
                                  lambda w: Int8Avx2(quantize_int8(w), None)], ids=["int4", "int4-a8", "int8"])
def test_a_row_computes_the_same_in_any_batch(make):
    kernel = make(torch.randn(74, 160))
    x = torch.randn(17, 160)
    alone = torch.cat([kernel(x[i:i + 1]) for i in range(17)])
    assert torch.equal(kernel(x), alone)
    assert torch.equal(kernel(x[5:12]), alone[5:12])
    assert kernel(x[:0]).shape == (0, 74)


@needs_avx2
def test_they_are_candidates_and_can_be_forced(tmp_path):
    w = torch.randn(64, 96)
    q4, q8 = quantize_int4(w, 32), quantize_int8(w)
    assert "int4-avx2" in candidates("int4", w, None, q4)
    assert "int8-avx2" in candidates("int8", w, None, q8)
    for fmt, q, name in (("int4", q4, "int4-avx2"), ("int8", q8, "int8-avx2")):
        builds = [candidates(fmt, w, None, q)]
        choice = KernelChoice(tmp_path / "k.json", forced=name)
        assert choice.choose(fmt, (64, 96), builds, torch.float32) == name
        assert builds[0][name]()(torch.randn(3, 96)).shape == (3, 64)


@needs_avx2
@pytest.mark.parametrize("dtype, kernel", [("int4", "int4-avx2"), ("int4", "int4-avx2-a8"), ("int8", "int8-avx2")])
def test_a_runner_on_the_avx2_kernel_matches_torch_s(dtype, kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    model_dir = build_tiny_model_dir("qwen2")
    tokens = torch.randint(0, VOCAB_SIZE, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    from tests.models.test_quant import logits
    ours, torch_s = (logits(ModelRunner(ModelSpec(name="m", source="tiny:qwen2", block_size=4, num_kv_blocks=32,
                                                   dtype=dtype, kernel=kernel), model_dir), tokens)
                     for kernel in (kernel, f"{dtype}-fp32"))
    span = torch_s.max() - torch_s.min()
    # one int8 digit per activation rounds each to about 8 bits, through four layers of random weights (0.046
    # of the span measured; its exact arithmetic is tested above); a wrong layout is off by about the span
    assert (ours - torch_s).abs().max() <= (0.1 if kernel.endswith("-a8") else 1e-2) * span


def test_isa_avx2_shows_the_choice_an_avx2_cpu_makes(monkeypatch):
    from tokenrouter.models import kernels
    monkeypatch.setenv("TOKENROUTER_ISA", "avx2")
    assert not {f for f in native.cpu_flags() if f.startswith(native.ABOVE_AVX2)}
    assert native.vnni_missing() and native.vnni() is None
    assert not kernels.bf16_fast()
    w = torch.randn(64, 96)
    offered = candidates("int4", w, None, quantize_int4(w, 32))
    assert not {"int4-vnni", "int4-vnni-a8"} & set(offered)
    assert "int8-vnni" not in candidates("int8", w, None, quantize_int8(w))
    assert ("int4-avx2" in offered) == ("int4-avx2-a8" in offered) == (not MISSING)
    limited = kernels.machine_key()
    monkeypatch.delenv("TOKENROUTER_ISA")
    more = any(f.startswith(native.ABOVE_AVX2) for f in native.cpu_flags())
    assert (kernels.machine_key() != limited) == more  # a timing cache of its own where it hides something
    monkeypatch.setenv("TOKENROUTER_ISA", "sse2")
    with pytest.raises(ValueError, match="TOKENROUTER_ISA"):
        native.cpu_flags()


def test_a_changed_native_kernel_gets_a_timing_cache_of_its_own(monkeypatch):
    """Cached kernel choices were timed on the kernels' code as it was: a new source (or flags, or torch) times
    them again instead of keeping choices a faster kernel may now lose."""
    from tokenrouter.models import kernels
    before = kernels.machine_key()
    assert native.version(native.KERNELS) == f"vnni={native._key(native.VNNI)},avx2={native._key(native.AVX2)}," \
                                             f"avxvnni={native._key(native.AVXVNNI)}"
    monkeypatch.setattr(native, "version", lambda natives=native.NATIVES: "vnni=0,avx2=0")
    assert kernels.machine_key() != before and kernels.machine()["native"] == "vnni=0,avx2=0"


def test_auto_counts_the_avx2_kernels_as_int4_vnni_s_arithmetic(monkeypatch):
    from tokenrouter.models.calibration import AGREEMENT_FLOOR, MEASURED, OUR_INT4, auto_choice
    monkeypatch.setitem(MEASURED, "m", {"int4": AGREEMENT_FLOOR - 0.01, "int4-vnni": AGREEMENT_FLOOR, "int8": 0.99})
    monkeypatch.setattr(native, "vnni_missing", lambda: "the CPU lacks avx512_vnni")
    monkeypatch.setattr(native, "avx2_missing", lambda: "")
    assert auto_choice("m").dtype == "int4" and "int4-avx2" in auto_choice("m").kernels
    monkeypatch.setitem(MEASURED, "m", {"int4-a8": AGREEMENT_FLOOR, "int8": 0.99})
    assert auto_choice("m").kernels == OUR_INT4["int4-a8"] and "int4-avx2-a8" in auto_choice("m").kernels
    monkeypatch.setattr(native, "avx2_missing", lambda: "the CPU lacks avx2")
    assert auto_choice("m").dtype == "int8"


def test_time_prints_each_candidate_beside_the_floor(monkeypatch, capsys, tmp_path):
    from tokenrouter.bench import roofline
    from tokenrouter.models import kernels
    monkeypatch.setattr(roofline, "measure_roofline", lambda **_: {"read_gbps": 10.0})
    out = tmp_path / "t.json"
    assert kernels.main(["--time", "int8:32x64,int4:36x64", "--batch", "1,2", "--runs", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "int8 32x64" in printed and "int4-fp32" in printed and "floor" in printed
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["floor_ms"] == pytest.approx((32 * 64 + 4 * 32) / 10.0 / 1e6)
    assert ("int8-avx2" in rows[0]["ms"]) == (not MISSING)
