"""The AVX512-VNNI kernels (tokenrouter/models/native.py, csrc/vnni_gemm.cpp): built where the machine can, as
exact as their arithmetic promises, and independent of the batch a row shares."""
from __future__ import annotations

import pytest
import torch

from tokenrouter.config import ModelSpec
from tokenrouter.engine.model_runner import ModelRunner
from tokenrouter.models import native
from tokenrouter.models.kernels import Int4, Int4Vnni, Int4VnniA8, Int8Vnni, candidates
from tokenrouter.models.quant import Int4Weight, Int8Weight, dequantize, quantize_int4, quantize_int8
from tokenrouter.models.tiny import VOCAB_SIZE, build_tiny_model_dir

MISSING = native.vnni_missing()
needs_vnni = pytest.mark.skipif(bool(MISSING), reason=f"the VNNI kernels cannot be built here: {MISSING}")


def test_it_is_built_wherever_nothing_is_missing():
    # a machine with the CPU flags, a compiler and ninja must get the kernel (a failed build only logs)
    assert (native.vnni() is not None) == (not MISSING), MISSING


def test_it_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("TOKENROUTER_NATIVE", "0")
    assert native.vnni_missing() == "TOKENROUTER_NATIVE=0"


def fp16_rounded(q: Int4Weight) -> torch.Tensor:
    """The weights as the kernel holds them: the codes with fp16 scales and zeros."""
    return dequantize(Int4Weight(q.codes, q.scale.half().float(), q.low.half().float(), q.group))


@needs_vnni
@pytest.mark.parametrize("n, k, group", [(70, 96, 32), (4864, 896, 32), (1536, 8960, 32), (130, 256, 128)])
def test_activations_keep_about_fifteen_bits(n, k, group):
    gen = torch.Generator().manual_seed(n)
    w, bias = torch.randn(n, k, generator=gen) * 0.02, torch.randn(n, generator=gen)
    q = quantize_int4(w, group)
    vnni, bf16 = Int4Vnni(q, bias), Int4(q, bias, torch.bfloat16)
    for m in (1, 2, 3, 5):
        x = torch.randn(m, k, generator=gen)
        x[0, 3] = 40.0  # an outlier: the rest of its block of 32 keeps its precision through the low digit
        exact = x @ fp16_rounded(q).T + bias
        err = (vnni(x) - exact).norm() / exact.norm()
        assert err < 2e-4, (m, err)  # an int8 activation alone: about 1e-2
        assert err < 0.1 * (bf16(x) - exact).norm() / exact.norm()  # well under bf16 activations' rounding


@needs_vnni
@pytest.mark.parametrize("n, k", [(70, 96), (4864, 896), (1536, 8960)])
def test_one_digit_activations_keep_about_eight_bits(n, k):
    # int4-vnni-a8: x ~ xs * hi per block of 32, xs = amax / 127; the error is the activations' rounding
    gen = torch.Generator().manual_seed(k)
    w, bias = torch.randn(n, k, generator=gen) * 0.02, torch.randn(n, generator=gen) * 0.01
    q = quantize_int4(w, 32)
    a8, two = Int4VnniA8(q, bias), Int4Vnni(q, bias)
    for m in (1, 2, 5, 7):
        x = torch.randn(m, k, generator=gen)
        exact = x @ fp16_rounded(q).T + bias
        blocks = x.reshape(m, -1, 32)
        amax = blocks.abs().amax(-1, keepdim=True)
        rounded = ((blocks * (127 / amax)).round() * (amax / 127)).reshape(m, k)
        # the codes' term on the rounded activations, the zero's on the exact ones (the fp32 sum of each block)
        zeros = fp16_rounded(Int4Weight(torch.zeros_like(q.codes), q.scale, q.low, q.group))
        expected = rounded @ (fp16_rounded(q) - zeros).T + x @ zeros.T + bias
        assert (a8(x) - expected).norm() / expected.norm() < 1e-5, m  # exactly that rounding, summed in fp32
        err = (a8(x) - exact).norm() / exact.norm()
        assert 1e-3 < err < 2e-2, (m, err)  # about 8 bits, well short of two digits' 15
        assert (two(x) - exact).norm() / exact.norm() < 0.1 * err


@needs_vnni
@pytest.mark.parametrize("n, k", [(70, 96), (37, 100), (4864, 896), (896, 4864)])
def test_int8_keeps_about_fifteen_bits_of_each_activation(n, k):
    gen = torch.Generator().manual_seed(n + k)
    w, bias = torch.randn(n, k, generator=gen) * 0.02, torch.randn(n, generator=gen)
    codes = quantize_int8(w).codes.clone()
    codes[0, :5], codes[1, :] = -128, 127  # the extremes of int8 (no quantizer here makes -128)
    q = Int8Weight(codes, quantize_int8(w).scale)
    kernel = Int8Vnni(q, bias)
    exact_w = q.codes.float() * q.scale[:, None]
    for m in (1, 2, 5, 6, 7, 16):
        x = torch.randn(m, k, generator=gen)
        x[0, 3] = 40.0  # an outlier: the rest of its block of 32 keeps its precision through the low digit
        exact = x.double() @ exact_w.double().T + bias.double()
        err = ((kernel(x).double() - exact).norm() / exact.norm()).item()
        assert err < 1e-4, (m, err)  # one int8 digit per activation: about 1e-2


@needs_vnni
@pytest.mark.parametrize("make", [lambda: Int4Vnni(quantize_int4(torch.randn(72, 160), 32), None),
                                  lambda: Int4VnniA8(quantize_int4(torch.randn(72, 160), 32), None),
                                  lambda: Int8Vnni(quantize_int8(torch.randn(72, 160)), None)],
                         ids=["two-digits", "one-digit", "int8"])
def test_a_row_computes_the_same_in_any_batch(make):
    kernel = make()
    x = torch.randn(16, 160)
    alone = torch.cat([kernel(x[i:i + 1]) for i in range(16)])
    for rows in (2, 3, 4, 5, 6, 7, 13, 16):  # passes of up to 6 rows, split evenly (16: 5, 5, 6)
        assert torch.equal(kernel(x[:rows]), alone[:rows]), rows
    assert kernel(x[:0]).shape == (0, 72)


@needs_vnni
def test_it_is_a_candidate_for_int8_and_for_int4_only_in_blocks_of_32():
    w = torch.randn(64, 96)
    assert {"int4-vnni", "int4-vnni-a8"} <= set(candidates("int4", w, None, quantize_int4(w, 32)))
    assert "int8-vnni" in candidates("int8", torch.randn(64, 80), None, quantize_int8(torch.randn(64, 80)))
    w = torch.randn(64, 80)  # 80 columns: int4 takes groups of 16 nowhere, so fake a 16-wide one
    q = Int4Weight(torch.zeros(64, 80, dtype=torch.uint8), torch.ones(64, 5), torch.zeros(64, 5), 16)
    assert not {"int4-vnni", "int4-vnni-a8"} & set(candidates("int4", w, None, q))


@needs_vnni
def test_a_runner_on_int4_vnni_matches_torch_s_int4_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    model_dir = build_tiny_model_dir("qwen2")
    tokens = torch.randint(0, VOCAB_SIZE, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    from tests.models.test_quant import logits
    ours, torch_s = (logits(ModelRunner(ModelSpec(name="m", source="tiny:qwen2", block_size=4, num_kv_blocks=32,
                                                   dtype="int4", kernel=kernel), model_dir), tokens)
                     for kernel in ("int4-vnni", "int4-fp32"))
    span = torch_s.max() - torch_s.min()
    # the two differ by the scales and zeros (fp16 in ours, fp32 in int4-fp32) over four layers of random weights
    assert (ours - torch_s).abs().max() <= 1e-2 * span


@needs_vnni
def test_a_runner_on_int8_vnni_matches_torch_s_int8_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    model_dir = build_tiny_model_dir("qwen2")
    tokens = torch.randint(0, VOCAB_SIZE, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    from tests.models.test_quant import logits
    runners = {kernel: ModelRunner(ModelSpec(name="m", source="tiny:qwen2", block_size=4, num_kv_blocks=32,
                                             dtype="int8", kernel=kernel), model_dir)
               for kernel in ("int8-vnni", "int8-fp32")}
    assert {k["kernel"] for k in runners["int8-vnni"].kernels.used.values()} == {"int8-vnni"}
    ours, torch_s = (logits(runner, tokens) for runner in runners.values())
    span = torch_s.max() - torch_s.min()
    # the same weights; ours rounds each activation to about 15 bits (a wrong layout is off by about the span)
    assert (ours - torch_s).abs().max() <= 1e-2 * span
