"""The Triton backend inside the model runner (on CPU under TRITON_INTERPRET=1, tests/conftest.py) against the
torch backend: prefill, catch-up and verifying chunks, mixed steps, decode, and the decode-graph stand-in."""
from __future__ import annotations

import pytest

from tests.models.runner_steps import steps
from tokenrouter.config import ModelSpec
from tokenrouter.engine.model_runner import ModelRunner
from tokenrouter.models.tiny import build_tiny_model_dir

pytest.importorskip("triton")


def runner(source: str, backend: str, block_size: int = 4) -> ModelRunner:
    spec = ModelSpec("m", f"tiny:{source}", block_size=block_size, num_kv_blocks=128, max_model_len=128,
                     attention_backend=backend)
    return ModelRunner(spec, build_tiny_model_dir(source))


@pytest.mark.parametrize("source,block_size", [("qwen2-large", 4), ("qwen3", 16), ("llama", 4)])
def test_triton_backend_matches_the_torch_backend_in_the_runner(source, block_size):
    plain, triton = runner(source, "torch", block_size), runner(source, "triton", block_size)
    assert triton.backend.name == "triton"
    for want, got in zip(steps(plain), steps(triton)):
        assert (got - want).abs().max().item() <= 1e-4


def test_triton_backend_under_the_graph_stand_in():
    plain, graphed = runner("qwen2-large", "torch"), runner("qwen2-large", "triton")
    graphed.use_cuda_graphs(4, capture=False)
    for want, got in zip(steps(plain), steps(graphed)):  # the last step: 3 decode rows padded to a bucket of 4
        assert (got - want).abs().max().item() <= 1e-4
