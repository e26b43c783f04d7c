"""Placement `ray` on a local Ray instance: the same tokens as `local`, tensor parallelism inside a
placement group, and no actor left after close."""
from __future__ import annotations

import os

import pytest

import tokenrouter
from tests.engine.placements import TP_LARGE, alive, run

ray = pytest.importorskip("ray")

PAIR = "config/tiny/pair.yaml"
POLICIES = ["schedule:every=3", "rolling:of=random,window=3,threshold=0.55", "query-confidence:threshold=0.1,tokens=3"]


@pytest.fixture(scope="module")
def reference():
    svc = tokenrouter.serve(PAIR)
    yield {(p, c): run(svc, p, c) for p in POLICIES for c in (1, 4, 16)}
    svc.close()


def test_ray_placement_writes_what_local_writes_and_leaves_nothing(reference):
    svc = tokenrouter.serve(PAIR, placement="ray", models=TP_LARGE)
    try:
        pids = [pid for e in svc.executors.values() for pid in e.pids]
        assert len(set(pids)) == 3 and os.getpid() not in pids
        for (policy, concurrency), ref in reference.items():
            assert run(svc, policy, concurrency) == ref, (policy, concurrency)
        stats = svc.stats()
        assert all(stats[m]["free_blocks"] == stats[m]["total_blocks"] for m in svc.models)
    finally:
        svc.close()
    assert not ray.is_initialized()  # the instance this engine started is gone, and its actors with it
    assert not any(alive(p) for p in pids)
