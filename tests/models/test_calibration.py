"""What `dtype: auto` may choose from the recorded greedy agreement."""
from __future__ import annotations

from tokenrouter.config import ModelSpec
from tokenrouter.engine.model_runner import resolve_dtype
from tokenrouter.models import calibration
from tokenrouter.models.calibration import AGREEMENT_FLOOR, MEASURED, auto_quantized


def test_the_smallest_dtype_at_the_floor_wins(monkeypatch):
    monkeypatch.setitem(MEASURED, "m", {"int4": AGREEMENT_FLOOR, "int8": 0.99})
    assert auto_quantized("m", vnni=False) == "int4"
    monkeypatch.setitem(MEASURED, "m", {"int4": AGREEMENT_FLOOR - 0.001, "int8": 0.99})
    assert auto_quantized("m", vnni=False) == "int8"
    monkeypatch.setitem(MEASURED, "m", {"int4": 0.5, "int8": 0.5})
    assert auto_quantized("m", vnni=False) is None
    assert auto_quantized("never-measured") is None


def test_int4_counts_the_record_of_the_kernel_that_runs(monkeypatch):
    monkeypatch.setitem(MEASURED, "m", {"int4": AGREEMENT_FLOOR - 0.001, "int4-vnni": AGREEMENT_FLOOR, "int8": 0.99})
    assert auto_quantized("m", vnni=True) == "int4"
    assert auto_quantized("m", vnni=False) == "int8"
    monkeypatch.setitem(MEASURED, "m", {"int4": AGREEMENT_FLOOR, "int8": 0.99})  # never measured on int4-vnni
    assert auto_quantized("m", vnni=True) == "int8"


def test_recorded_figures_are_shares_and_auto_follows_them():
    for source, shares in calibration.MEASURED.items():
        assert all(0.0 <= v <= 1.0 for v in shares.values()), source
        spec = ModelSpec(name="m", source=source, dtype="auto")
        assert resolve_dtype(spec) == auto_quantized(source) or auto_quantized(source) is None
    # measured 2026-12-04: int4 agrees >= 97% on the 1.5B; on the 0.5B only through the int4-vnni kernel
    assert auto_quantized("embedded:qwen2.5-coder-0.5b-instruct", vnni=False) == "int8"
    assert auto_quantized("embedded:qwen2.5-coder-0.5b-instruct", vnni=True) == "int4"
    assert auto_quantized("embedded:qwen2.5-coder-1.5b-instruct", vnni=False) == "int4"
    assert auto_quantized("embedded:qwen2.5-coder-1.5b-instruct", vnni=True) == "int4"
