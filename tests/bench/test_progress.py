"""Progress bars of long commands (`tokenrouter/bench/progress.py`): on stderr, with requests done and
tokens/s, and the bar's batch generation giving what `Service.generate_batch` gives."""
from __future__ import annotations

import pytest

from tokenrouter.bench.progress import Requests, generate_batch

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
