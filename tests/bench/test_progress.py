"""Progress bars of long commands (`tokenrouter/bench/progress.py`): on stderr, with requests done and
tokens/s, and the bar's batch generation giving what `Service.generate_batch` gives."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tokenrouter.bench.progress import Requests, free_port, generate_batch, ready_line, rss_bytes, step

PROMPTS = ["one", "two", "three", "four", "five"]


def test_the_batch_with_a_bar_equals_the_service_batch(svc, capsys):
    common = {"policy": "schedule:every=2", "max_tokens": 6}
    ours = generate_batch(svc, PROMPTS, 2, "tiny batch", **common)
    theirs = svc.generate_batch(PROMPTS, concurrency=2, **common)
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    assert [o.finish_reason for o in ours] == ["length"] * 5
    captured = capsys.readouterr()
    assert "tiny batch" in captured.err and "5/5" in captured.err and "tok/s" in captured.err
    assert captured.out == ""  # stdout stays for JSON lines and tables


def test_bad_requests_are_refused_before_any_is_sent(svc):
    before = svc.stats()
    with pytest.raises(ValueError, match="max_tokens"):
        generate_batch(svc, PROMPTS, 2, "bad", max_tokens=0)
    with pytest.raises(ValueError, match="concurrency"):
        generate_batch(svc, PROMPTS, 0, "bad")
    assert svc.stats()["small"]["steps"] == before["small"]["steps"]


def test_a_shared_bar_counts_every_batch_and_failures(capsys):
    bar = Requests(3, "shared")
    bar.done(4)
    bar.done(0, failed=True)
    bar.done(2)
    bar.close()
    err = capsys.readouterr().err
    assert "3/3" in err and "failed=1" in err and bar.tokens == 6


def test_a_start_killed_during_a_step_leaves_the_step_in_its_log(tmp_path):
    # SIGKILL, as the OOM killer sends it: nothing runs after it, so the line must be written before the step
    code = ("import os, signal\nfrom tokenrouter.bench import progress\n"
            "line = progress.step('time kernels of qwen-tiny', 7, 'shape')\nos.kill(os.getpid(), signal.SIGKILL)\n")
    log = tmp_path / "start.log"
    with open(log, "w") as err:
        done = subprocess.run([sys.executable, "-c", code], stderr=err, check=False)
    assert done.returncode == -signal.SIGKILL
    assert "[tokenrouter] time kernels of qwen-tiny" in log.read_text()


def test_a_step_without_a_total_shows_its_time(capsys):
    with step("convert x.gguf"):
        pass
    err = capsys.readouterr().err
    assert "[tokenrouter] convert x.gguf 00:00" in err and "it/s" not in err


def test_the_ready_line_names_each_model_its_kernels_memory_and_the_url(svc):
    port = free_port("127.0.0.1", None)
    line = ready_line(svc, f"http://127.0.0.1:{port}")
    assert line.startswith("[tokenrouter] ready: small float32 [") and "large float32 [" in line
    assert "GB resident" in line and line.endswith(f"http://127.0.0.1:{port}")
    runner = svc.executors["large"].runner
    assert runner.kernels.summary().split(" x")[0] in line  # the kernel most shapes took
    assert rss_bytes() > 0 and 7860 <= port < 7960


def test_the_ready_line_of_a_client_names_its_server():
    class Client:
        models, url = ["small", "large"], "http://127.0.0.1:30000"

    assert ready_line(Client(), "http://127.0.0.1:7861") == \
        "[tokenrouter] ready: small, large on http://127.0.0.1:30000; http://127.0.0.1:7861"
