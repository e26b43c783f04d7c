"""Placement `ray` on a local Ray instance: the same tokens as `local`, tensor parallelism inside a
placement group, and no actor left after close."""
from __future__ import annotations

import math
import os

import pytest

import tokenrouter

ray = pytest.importorskip("ray")

PAIR = "config/tiny/pair.yaml"
PROMPTS = ["def add(a, b):", "hello", "The quick brown fox", "x" * 40, "Once upon a time", "import os\n",
           "Q: 2+2?", "SELECT * FROM t WHERE", "<html>", "fn main() {", "1, 2, 3,", "Dear Sir,", "# TODO",
           "while True:", "lorem ipsum dolor", "print(", "a = [1,", "class Foo:", "// c", "$ ls"]
POLICIES = ["schedule:every=3", "rolling:of=random,window=3,threshold=0.55", "query-confidence:threshold=0.1,tokens=3"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run(svc, policy: str, concurrency: int):
    requests = [{"prompt": p, "max_tokens": 5 + 3 * (i % 4)} for i, p in enumerate(PROMPTS[:concurrency + 4])]
    outs = svc.generate_batch(requests, concurrency=concurrency, policy=policy)
    return [(o.token_ids, [r.model for r in o.tokens], [None if math.isnan(r.score) else round(r.score, 5)
                                                         for r in o.tokens]) for o in outs]


@pytest.fixture(scope="module")
def reference():
    svc = tokenrouter.serve(PAIR)
    yield {(p, c): run(svc, p, c) for p in POLICIES for c in (1, 4, 16)}
    svc.close()


def test_ray_placement_writes_what_local_writes_and_leaves_nothing(reference):
    models = [{"name": "small", "source": "tiny:qwen2-small", "block_size": 4, "num_kv_blocks": 512,
               "max_model_len": 1024},
              {"name": "large", "source": "tiny:qwen2-large", "block_size": 4, "num_kv_blocks": 512,
               "max_model_len": 1024, "tensor_parallel_size": 2}]
    svc = tokenrouter.serve(PAIR, placement="ray", models=models)
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
