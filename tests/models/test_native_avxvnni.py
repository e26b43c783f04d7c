"""The AVX2 kernels built with AVX-VNNI (tokenrouter/models/native.py `avxvnni`, csrc/avx2_gemm.cpp): built where
the CPU has AVX-VNNI, the AVX2 build's floats bit for bit (which test_native_avx2.py holds to a float64
reference and to the AVX512-VNNI kernels), offered as candidates, and what TOKENROUTER_ISA=avxvnni shows."""
from __future__ import annotations

import pytest
import torch

from tokenrouter.config import ModelSpec
from tokenrouter.engine.model_runner import ModelRunner
from tokenrouter.models import native
from tokenrouter.models.kernels import (Int4Avx2, Int4Avx2A8, Int4AvxVnni, Int4AvxVnniA8, Int8Avx2, Int8AvxVnni,
                                        candidates, machine_key, superseded)
from tokenrouter.models.quant import quantize_int4, quantize_int8
from tokenrouter.models.tiny import build_tiny_model_dir

from tests.models.test_native_avx2 import assert_same_int8_floats

MISSING = native.avxvnni_missing()
needs_avxvnni = pytest.mark.skipif(bool(MISSING), reason=f"the AVX-VNNI kernels cannot be built here: {MISSING}")
ROWS = range(1, 18)  # every split of the kernels' row passes (up to 6 rows a pass)


def test_it_is_built_wherever_nothing_is_missing():
    assert (native.avxvnni() is not None) == (not MISSING), MISSING
    if "avx_vnni" not in native.cpu_flags():
        assert "avx_vnni" in MISSING or MISSING == "TOKENROUTER_NATIVE=0"


def test_it_is_a_build_of_the_avx2_source_of_its_own():
    assert native.AVXVNNI.source == native.AVX2.source and "-mavxvnni" in native.AVXVNNI.flags
    assert native._module_file(native.AVXVNNI) != native._module_file(native.AVX2)  # both can load in one process
    assert native.AVXVNNI.cpu_flags > native.AVX2.cpu_flags


@needs_avxvnni
@pytest.mark.parametrize("pair", [(Int4AvxVnni, Int4Avx2), (Int4AvxVnniA8, Int4Avx2A8)],
                         ids=["two-digits", "one-digit"])
@pytest.mark.parametrize("n, k, group", [(70, 96, 32), (132, 256, 128), (38, 1536, 32)])
def test_int4_gives_int4_avx2_s_floats(n, k, group, pair):
    gen = torch.Generator().manual_seed(n + k)
    q, bias = quantize_int4(torch.randn(n, k, generator=gen), group), torch.randn(n, generator=gen)
    ours, avx2 = pair[0](q, bias), pair[1](q, bias)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen) * 3
        x[0, 3] = 40.0  # an outlier: the rest of its block takes small digits
        assert torch.equal(ours(x), avx2(x)), m


@needs_avxvnni
@pytest.mark.parametrize("n, k", [(70, 96), (37, 100), (16, 40), (38, 1536)])
def test_int8_gives_int8_avx2_s_floats(n, k):
    assert_same_int8_floats(Int8AvxVnni, Int8Avx2, n, k)


@needs_avxvnni
def test_they_are_candidates():
    w = torch.randn(64, 96)
    assert {"int4-avxvnni", "int4-avxvnni-a8"} <= set(candidates("int4", w, None, quantize_int4(w, 32)))
    assert "int8-avxvnni" in candidates("int8", w, None, quantize_int8(w))


@needs_avxvnni
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_the_avx2_build_is_not_timed_where_this_one_is_and_runs_where_named(dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    assert superseded() == {"int8-avx2", "int4-avx2", "int4-avx2-a8"}
    model_dir = build_tiny_model_dir("qwen2")

    def runner(kernel: str = "auto") -> ModelRunner:
        return ModelRunner(ModelSpec(name="m", source="tiny:qwen2", block_size=4, num_kv_blocks=8, dtype=dtype,
                                     kernel=kernel), model_dir)

    timed = [entry for entry in runner().kernels.used.values() if "candidates" in entry]
    assert timed and all(f"{dtype}-avxvnni" in e["candidates"] and f"{dtype}-avx2" not in e["candidates"]
                         for e in timed)
    assert {e["kernel"] for e in runner(f"{dtype}-avx2").kernels.used.values()} == {f"{dtype}-avx2"}


def test_only_a_build_with_a_successor_here_is_superseded(monkeypatch):
    assert native.superseded(native.AVX2) == (not native.avxvnni_missing())
    assert not any(native.superseded(n) or native.superseded(n, built=True)
                   for n in (native.VNNI, native.AVXVNNI, native.CPU_OPS))
    monkeypatch.setenv("TOKENROUTER_ISA", "avx2")  # the successor's AVX-VNNI hidden
    assert not native.superseded(native.AVX2) and not native.superseded(native.AVX2, built=True)
    assert superseded() == set()


def test_isa_avxvnni_shows_an_avx2_cpu_with_avx_vnni(monkeypatch):
    has = "avx_vnni" in native.cpu_flags()
    hidden = any(f.startswith(native.HIDDEN["avxvnni"]) for f in native.cpu_flags())
    all_of = machine_key()
    monkeypatch.setenv("TOKENROUTER_ISA", "avxvnni")
    assert not {f for f in native.cpu_flags() if f.startswith(("avx512", "amx"))}
    assert ("avx_vnni" in native.cpu_flags()) == has
    assert native.vnni_missing() and native.vnni() is None
    w = torch.randn(64, 96)
    offered = set(candidates("int4", w, None, quantize_int4(w, 32)))
    assert not {"int4-vnni", "int4-vnni-a8"} & offered
    assert ("int4-avxvnni-a8" in offered) == (not native.avxvnni_missing())
    limited = machine_key()
    monkeypatch.setenv("TOKENROUTER_ISA", "avx2")
    assert "avx_vnni" not in native.cpu_flags() and native.avxvnni_missing().endswith("(TOKENROUTER_ISA=avx2)")
    assert machine_key() != limited or not has  # a timing cache of its own for each view of the CPU
    assert (limited != all_of) == hidden


def test_kernel_int4_a8_names_the_arithmetic_and_the_machine_picks_the_kernel(tmp_path, monkeypatch):
    """`kernel: int4-a8` runs int4 on our one-digit kernels, whichever this machine builds and times fastest (a
    config that says so runs on an AVX2 laptop, an AVX-VNNI one and an AVX-512 server alike)."""
    from tokenrouter.config import ConfigError
    from tokenrouter.models.calibration import OUR_INT4, record_of
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="kernel: int4-a8 .* needs dtype int4 or auto, got int8"):
        ModelSpec(name="m", source="tiny:qwen2", dtype="int8", kernel="int4-a8")
    assert record_of("int4-a8") == "int4-a8" and record_of("int4-avxvnni-a8") == "int4-a8"
    runner = ModelRunner(ModelSpec(name="m", source="tiny:qwen2", block_size=4, num_kv_blocks=8, dtype="int4",
                                   kernel="int4-a8"), build_tiny_model_dir("qwen2"))
    used = {entry["kernel"] for entry in runner.kernels.used.values()}
    if not native.vnni_missing() or not native.avx2_missing():
        assert used <= set(OUR_INT4["int4-a8"]), used
        assert all(not entry.get("forced") for entry in runner.kernels.used.values())  # timed, not forced
