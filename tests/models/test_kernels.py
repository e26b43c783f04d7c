"""The kernel choice cache: what it keeps, what it refuses, its versions, and `--check`."""
from __future__ import annotations

import json

import pytest
import torch

from tokenrouter.models import kernels
from tokenrouter.models.kernels import CACHE_VERSION, KernelChoice, candidates
from tokenrouter.models.kernels_timing import Timing

IDLE, BUSY = 0.01, 0.6


def scripted(monkeypatch, *timings: Timing) -> list[int]:
    """kernels.time_kernels answers these timing sets in turn; returns the list of calls."""
    calls: list[int] = []

    def fake(builds, in_features, dtype, batches):
        calls.append(in_features)
        return timings[min(len(calls), len(timings)) - 1]

    monkeypatch.setattr(kernels, "time_kernels", fake)
    return calls


def builds():
    return [candidates("float32", torch.randn(8, 8), None)]


GOOD = {"mkl": [1.0, 2.0, 4.0], "w@x.T": [0.5, 1.0, 3.0], "x@Wt": [2.0, 3.0, 5.0], "onednn": [1.0, 2.0, 4.0]}


def test_a_timing_on_an_idle_machine_is_cached_with_when_and_under_what_load(tmp_path, monkeypatch):
    calls = scripted(monkeypatch, Timing(GOOD, IDLE, [0.1, 0.2, 0.3], "2026-12-05T10:00:00Z"))
    assert KernelChoice(tmp_path / "k.json").choose("float32", (8, 8), builds(), torch.float32) == "w@x.T"
    data = json.loads((tmp_path / "k.json").read_text())
    assert data["version"] == CACHE_VERSION and data["machine"]["threads"] == torch.get_num_threads()
    entry = data["entries"]["float32|8x8"]
    assert entry["taken"] == "2026-12-05T10:00:00Z" and entry["load"] == {"others": IDLE, "loadavg": [0.1, 0.2, 0.3]}
    assert entry["layers"] == 1 and entry["act"] == "fp32"
    assert KernelChoice(tmp_path / "k.json").choose("float32", (8, 8), builds(), torch.float32) == "w@x.T"
    assert len(calls) == 1


def test_a_busy_timing_is_timed_again_and_not_cached_when_still_busy(tmp_path, monkeypatch):
    slow_small_rows = {**GOOD, "w@x.T": [3.0, 3.0, 3.0]}
    calls = scripted(monkeypatch, Timing(slow_small_rows, BUSY), Timing(GOOD, BUSY * 0.8))
    choice = KernelChoice(tmp_path / "k.json")
    assert choice.choose("float32", (8, 8), builds(), torch.float32) == "w@x.T"  # the quieter set serves now
    assert len(calls) == 2 and "busy" in choice.uncached["float32|8x8"]
    assert not (tmp_path / "k.json").exists()
    KernelChoice(tmp_path / "k.json").choose("float32", (8, 8), builds(), torch.float32)
    assert len(calls) == 4  # the next start times it again


def test_a_busy_timing_then_an_idle_one_caches_the_idle_one(tmp_path, monkeypatch):
    calls = scripted(monkeypatch, Timing({**GOOD, "mkl": [0.1, 0.2, 0.3]}, BUSY), Timing(GOOD, IDLE))
    assert KernelChoice(tmp_path / "k.json").choose("float32", (8, 8), builds(), torch.float32) == "w@x.T"
    assert len(calls) == 2
    assert KernelChoice(tmp_path / "k.json").entries["float32|8x8"]["load"]["others"] == IDLE


def test_rows_faster_than_fewer_rows_is_cached_only_when_reproduced(tmp_path, monkeypatch):
    odd = {**GOOD, "mkl": [1.0, 14.6, 7.6]}
    calls = scripted(monkeypatch, Timing(odd, IDLE), Timing({**odd, "mkl": [1.0, 3.0, 7.6]}, IDLE))
    choice = KernelChoice(tmp_path / "k.json")
    choice.choose("float32", (8, 8), builds(), torch.float32)
    assert len(calls) == 2 and "float32|8x8" not in choice.uncached  # the second set is consistent
    scripted(monkeypatch, Timing(odd, IDLE), Timing({**odd, "mkl": [1.05, 14.0, 7.7]}, IDLE))
    again = KernelChoice(tmp_path / "r.json")
    again.choose("float32", (8, 8), builds(), torch.float32)
    assert again.uncached == {} and "float32|8x8" in KernelChoice(tmp_path / "r.json").entries  # a CPU's property
    scripted(monkeypatch, Timing(odd, IDLE), Timing({**odd, "mkl": [1.0, 2.0, 1.0]}, IDLE))
    noisy = KernelChoice(tmp_path / "n.json")
    noisy.choose("float32", (8, 8), builds(), torch.float32)
    assert "faster with more rows" in noisy.uncached["float32|8x8"] and not (tmp_path / "n.json").exists()


def test_a_version_1_cache_loads_and_its_shapes_are_timed_again(tmp_path, monkeypatch):
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"float32|8x8": {"kernel": "mkl", "candidates": list(builds()[0]),
                                                "batches": [1, 4, 16], "ms": {"mkl": [1.0, 14.6, 7.6]}}}))
    calls = scripted(monkeypatch, Timing(GOOD, IDLE))
    assert KernelChoice(path).choose("float32", (8, 8), builds(), torch.float32) == "w@x.T"
    assert len(calls) == 1
    data = json.loads(path.read_text())
    assert data["version"] == CACHE_VERSION and set(data["entries"]) == {"float32|8x8"}


def test_processes_sharing_the_cache_keep_each_others_entries(tmp_path, monkeypatch):
    scripted(monkeypatch, Timing(GOOD, IDLE))
    path = tmp_path / "k.json"
    one, two = KernelChoice(path), KernelChoice(path)  # both read the empty cache
    one.choose("float32", (8, 8), builds(), torch.float32)
    two.choose("float32", (16, 8), [candidates("float32", torch.randn(16, 8), None)], torch.float32)
    assert set(KernelChoice(path).entries) == {"float32|8x8", "float32|16x8"}


def test_check_reports_choices_now_beaten_by_more_than_ten_percent(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path))
    scripted(monkeypatch, Timing(GOOD, IDLE))
    choice = KernelChoice()
    choice.choose("float32", (8, 8), builds(), torch.float32)
    assert choice.path.parent == tmp_path / "kernels"
    (tmp_path / "kernels" / "old.json").write_text(json.dumps({"float32|8x8": {"kernel": "mkl"}}))
    holds = {**GOOD, "mkl": [0.55, 1.1, 3.2]}  # the cached w@x.T within 10% of the now fastest mkl
    scripted(monkeypatch, Timing(holds, IDLE))
    assert kernels.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert "holds" in out and "old.json: cache version 1" in out
    beaten = {**GOOD, "mkl": [0.4, 0.8, 2.0]}
    scripted(monkeypatch, Timing(beaten, BUSY))
    assert kernels.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "BEATEN by mkl" in out and "not conclusive: the machine was busy" in out


def test_help_prints(capsys):
    with pytest.raises(SystemExit) as exit_:
        kernels.main(["--help"])
    assert exit_.value.code == 0 and "now beaten by more than 10%" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_check_rebuilds_quantized_candidates_of_a_shape(fmt):
    found = kernels.random_candidates(fmt, (32, 64), 32)
    assert all(k.startswith(fmt) for k in found)
    x = torch.randn(2, 64)
    assert found[next(iter(found))]()(x).shape == (2, 32)
