"""What `dtype: auto` may choose from the recorded greedy agreement."""
from __future__ import annotations

from tokenrouter.config import ModelSpec
from tokenrouter.engine.model_runner import resolve_dtype
from tokenrouter.models import calibration
from tokenrouter.models.calibration import AGREEMENT_FLOOR, MEASURED, OUR_INT4, TORCH_INT4, auto_choice


def test_the_smallest_dtype_at_the_floor_wins(monkeypatch):
    monkeypatch.setitem(MEASURED, "m", {"int4": AGREEMENT_FLOOR, "int8": 0.99})
    assert auto_choice("m", ours=False) == ("int4", TORCH_INT4, "int4")
    monkeypatch.setitem(MEASURED, "m", {"int4": AGREEMENT_FLOOR - 0.001, "int8": 0.99})
    assert auto_choice("m", ours=False).dtype == "int8"
    monkeypatch.setitem(MEASURED, "m", {"int4": 0.5, "int8": 0.5})
    assert auto_choice("m", ours=False).dtype is None
    assert auto_choice("never-measured").dtype is None


def test_int4_counts_the_record_of_the_kernels_that_run(monkeypatch):
    monkeypatch.setitem(MEASURED, "m", {"int4": AGREEMENT_FLOOR - 0.001, "int4-vnni": AGREEMENT_FLOOR, "int8": 0.99})
    assert auto_choice("m", ours=True) == ("int4", OUR_INT4["int4-vnni"], "int4-vnni")
    assert auto_choice("m", ours=False).dtype == "int8"
    monkeypatch.setitem(MEASURED, "m", {"int4": AGREEMENT_FLOOR, "int8": 0.99})  # never measured on ours
    assert auto_choice("m", ours=True).dtype == "int8"


def test_one_digit_activations_win_where_they_reach_the_floor(monkeypatch):
    monkeypatch.setitem(MEASURED, "m", {"int4-a8": AGREEMENT_FLOOR, "int4-vnni": 0.99, "int8": 0.99})
    assert auto_choice("m", ours=True) == ("int4", OUR_INT4["int4-a8"], "int4-a8")
    monkeypatch.setitem(MEASURED, "m", {"int4-a8": AGREEMENT_FLOOR - 0.001, "int4-vnni": 0.99, "int8": 0.99})
    assert auto_choice("m", ours=True) == ("int4", OUR_INT4["int4-vnni"], "int4-vnni")


def test_a_kernel_asked_for_by_name_counts_its_own_arithmetic(monkeypatch):
    monkeypatch.setitem(MEASURED, "m", {"int4-a8": AGREEMENT_FLOOR - 0.001, "int4-vnni": 0.99, "int4": 0.99,
                                        "int8": 0.99})
    assert auto_choice("m", "int4-avx2-a8", ours=True).dtype == "int8"
    assert auto_choice("m", "int4-avx2", ours=True) == ("int4", (), "int4-vnni")  # the name binds, not auto
    assert auto_choice("m", "int4-bf16", ours=True) == ("int4", (), "int4")


def test_recorded_figures_are_shares_and_auto_follows_them():
    for source, shares in calibration.MEASURED.items():
        assert all(0.0 <= v <= 1.0 for v in shares.values()), source
        spec = ModelSpec(name="m", source=source, dtype="auto")
        assert resolve_dtype(spec) == auto_choice(source).dtype or auto_choice(source).dtype is None
    # measured 2026-12-06 on 8 prompts x up to 128 tokens: int4 agrees >= 97% on the 1.5B on every arithmetic,
    # one int8 digit per activation too; on the 0.5B on none (96.3-96.5%), so it takes int8
    small, large = "embedded:qwen2.5-coder-0.5b-instruct", "embedded:qwen2.5-coder-1.5b-instruct"
    assert auto_choice(small, ours=False) == auto_choice(small, ours=True) == ("int8", (), "int8")
    assert auto_choice(large, ours=False) == ("int4", TORCH_INT4, "int4")
    assert auto_choice(large, ours=True) == ("int4", OUR_INT4["int4-a8"], "int4-a8")


def test_the_benchmark_measures_each_int4_arithmetic_under_its_record(monkeypatch):
    from tokenrouter.bench.runner import arithmetics
    spec = ModelSpec(name="m", source="tiny:qwen2")
    monkeypatch.setattr(calibration, "our_int4_built", lambda: True)
    assert arithmetics(spec, ["float32", "int4", "int8"]) == [
        ("float32", "", None), ("int4", "int4-a8", OUR_INT4["int4-a8"]), ("int4", "int4-vnni", OUR_INT4["int4-vnni"]),
        ("int4", "int4", TORCH_INT4), ("int8", "", None)]
    monkeypatch.setattr(calibration, "our_int4_built", lambda: False)
    assert arithmetics(spec, ["int4"]) == [("int4", "int4", TORCH_INT4)]
    # a kernel named in the config is the arithmetic: measured once, under its record
    named = [arithmetics(ModelSpec(name="m", source="tiny:qwen2", kernel=k), ["int4"])
             for k in ("int4-avx2", "int4-vnni-a8", "int4-bf16")]
    assert named == [[("int4", "int4-vnni", None)], [("int4", "int4-a8", None)], [("int4", "int4", None)]]
