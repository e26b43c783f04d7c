"""`bench first-start`: the README's demo command split into install and start, and a real first start of the app
(on the tiny pair) measured until its ready line."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tokenrouter.bench import first_start
from tokenrouter.bench.first_start import descendants, readme_demo_command, split_demo_command

REPO = Path(__file__).resolve().parents[2]


def test_the_readme_demo_command_is_an_install_then_the_app():
    install, start = split_demo_command(readme_demo_command(REPO / "README.md"))
    assert "pip install" in install and not install.endswith("&&")
    assert start[-2:] == ["-m", "app"]


def test_a_readme_without_the_marker_or_a_command_without_the_app_is_refused(tmp_path):
    (tmp_path / "README.md").write_text("# nothing\n")
    with pytest.raises(ValueError, match="ci:demo"):
        readme_demo_command(tmp_path / "README.md")
    with pytest.raises(ValueError, match="does not end with starting the app"):
        split_demo_command("pip install -e . && python -m tokenrouter.demo")


def test_a_process_tree_is_found_from_its_root():
    assert descendants(os.getpid())[0] == os.getpid()


def test_first_start_of_the_app_on_an_empty_cache_reports_its_steps_and_peak(tmp_path):
    result = first_start.first_start(REPO, sys.executable, tmp_path / "cache",
                                     "config/tiny/pair.yaml", timeout=300)
    assert result["ready"].startswith("[tokenrouter] ready:") and "http://127.0.0.1:" in result["ready"]
    # the tiny models were built into the empty cache, loaded, and their kernels timed there
    assert (tmp_path / "cache" / "tiny").is_dir()
    assert any(step.startswith("[tokenrouter] load ") for step in result["steps"])
    assert any("time kernels of" in step for step in result["steps"])
    assert 50 * 2**20 < result["peak_bytes"] < 8 * 2**30
    assert result["app_maxrss_bytes"] >= 50 * 2**20
    assert max(result["step_peak_bytes"].values()) == result["peak_bytes"]
    started = result["step_started_s"]
    assert len(started) == len(result["steps"]) and started == sorted(started)
    assert 0 < started[0] and started[-1] <= result["ready_s"] <= result["seconds"]


def test_the_step_under_way_is_known_from_the_first_draw_of_its_bar():
    """A bar ends its line only when it closes; the step it draws counts from its first state, so the memory a
    long step takes is not put down to the step before it (the 1.5B's quantization was, to time kernels)."""
    log = first_start.StartLog()
    log.feed("[tokenrouter] time kernels of a: 100%|#| 5/5 [00:02<00:00]\n[tokenrouter] load and quantize b:   0%|")
    assert first_start._step_key(log.last) == "[tokenrouter] load and quantize b"
    log.feed("          | 0/7 [00:00<?]\r[tokenrouter] load and qua")  # a redraw cut short names no step
    assert first_start._step_key(log.last) == "[tokenrouter] load and quantize b"
    log.feed("ntize b: 100%|#| 7/7 [01:08<00:00]\n[tokenrouter] profile small's steps 00:00")
    log.feed("\r[tokenrouter] profile small's steps 00:11\n[tokenrouter] ready: small int4; http://127.0.0.1:7860\n")
    assert log.ready.startswith("[tokenrouter] ready:")
    assert [first_start._step_key(s) for s in log.steps] == [
        "[tokenrouter] time kernels of a", "[tokenrouter] load and quantize b", "[tokenrouter] profile small's steps"]
    assert log.steps[1].endswith("7/7 [01:08<00:00]") and log.steps[2].endswith("00:11")
    assert len(log.started) == 3 and log.started == sorted(log.started) and log.ready_at >= log.started[-1]
    assert all(a <= b for a, b in zip(log.started, log.ended))
    # steps side by side: a line from another step in between does not make a step a new one
    log = first_start.StartLog()
    log.feed("[tokenrouter] convert a:   0%|")
    log.feed("\n[tokenrouter] built avx2 kernels in the background in 32 s\n[tokenrouter] convert a:  50%|")
    log.feed("\r[tokenrouter] convert a: 100%|\n")
    assert log.steps == ["[tokenrouter] convert a: 100%|", "[tokenrouter] built avx2 kernels in the background in 32 s"]
