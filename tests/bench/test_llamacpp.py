"""llama.cpp's time is the median of several child runs, with each run's time kept (tokenrouter/bench/llamacpp.py)."""
from __future__ import annotations

from tokenrouter.bench.llamacpp import combine


def test_the_median_run_is_reported_with_every_runs_time():
    runs = [{"decode_ms": 71.2, "threads": 2}, {"decode_ms": 55.5, "threads": 2}, {"decode_ms": 60.1, "threads": 2}]
    out = combine(runs)
    assert out["decode_ms"] == 60.1
    assert out["decode_ms_runs"] == [71.2, 55.5, 60.1]
    assert "failed_runs" not in out


def test_failed_runs_are_counted_and_an_all_failed_measurement_is_its_error():
    out = combine([{"error": "exit status -11: SIGSEGV"}, {"decode_ms": 58.0, "threads": 2}])
    assert out["decode_ms"] == 58.0 and out["failed_runs"] == 1
    assert combine([{"error": "a"}, {"error": "not installed"}]) == {"error": "not installed"}
