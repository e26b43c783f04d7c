"""The KV budget: the largest step's shape, the arithmetic on fake CUDA figures (the error included), the sizing it
drives in the runner, and the profile step run on a CPU, where it measures nothing but must leave the real cache
untouched. What it measures on CUDA is checked in tests/gpu/test_cuda.py."""
from __future__ import annotations

import pytest
import torch

from tokenrouter.config import ConfigError, EngineConfig, ModelSpec, SchedulerSpec
from tokenrouter.engine.kv_budget import GIB, MemoryProfile, StepLimits
from tokenrouter.engine.model_runner import Chunk, ModelRunner
from tokenrouter.models.tiny import build_tiny_model_dir

from tests.engine.test_cuda_graphs import greedy, prompts


def runner(**spec) -> ModelRunner:
    return ModelRunner(ModelSpec("m", "tiny:qwen2-large", block_size=4, num_kv_blocks=256, max_model_len=160, **spec),
                       build_tiny_model_dir("qwen2-large"))


@pytest.mark.parametrize("seqs,tokens,length", [(64, 2048, 160), (64, 2048, 4096), (8, 100, 10), (64, 20, 4096),
                                                (1, 4096, 512), (3, 7, 5)])
def test_the_largest_step_takes_every_token_it_can_at_the_longest_contexts(seqs, tokens, length):
    limits = StepLimits(seqs, tokens, length)
    step = limits.largest_step()
    assert sum(n for n, _ in step) == min(tokens, seqs * length)
    assert len(step) == min(seqs, tokens)
    assert all(1 <= n <= length and start + n == length for n, start in step)
    assert step[0][0] == max(n for n, _ in step)  # one chunk as long as the others leave it
    decode = limits.largest_decode()
    assert decode == [(1, length - 1)] * min(seqs, tokens)


def test_the_budget_is_what_utilization_leaves_after_weights_activations_and_graphs():
    memory = MemoryProfile(total=80 * GIB, in_use=17 * GIB, weights=16 * GIB, activations=4 * GIB, graphs=GIB // 2)
    assert memory.kv_bytes(0.9) == int(80 * GIB * 0.9) - 17 * GIB - 4 * GIB - GIB // 2
    assert memory.kv_bytes(0.25) < 0


def test_no_room_names_gpu_memory_utilization_and_the_figures():
    memory = MemoryProfile(total=80 * GIB, in_use=17 * GIB, weights=16 * GIB, activations=4 * GIB, graphs=GIB // 2)
    error = memory.no_room("large", "cuda:0", 0.25, StepLimits(64, 4096, 8192))
    message = str(error)
    assert isinstance(error, ValueError)
    for figure in ("gpu_memory_utilization=0.25", "80.00 GiB on cuda:0", "17.00 GiB in use", "16.00 GiB of them",
                   "4.00 GiB for the activations", "4096 tokens in up to 64 sequences", "0.50 GiB for CUDA graphs"):
        assert figure in message, figure


def test_the_runner_sizes_its_pool_from_the_profile_and_refuses_when_nothing_is_left():
    r = runner()
    r.spec.num_kv_blocks = 0  # as if sized from gpu_memory_utilization on CUDA, with these figures measured
    per_block = r._block_bytes()
    r.memory = MemoryProfile(total=100 * per_block, in_use=40 * per_block, weights=30 * per_block,
                             activations=25 * per_block + 1, graphs=4 * per_block)
    r.spec.gpu_memory_utilization = 0.9
    # the activations' extra byte costs a block, and the pool's scratch block (never handed out) one more
    assert r._num_blocks() == 90 - 40 - 26 - 4 - 1
    r.spec.gpu_memory_utilization = 0.6
    with pytest.raises(ValueError, match=r"m: gpu_memory_utilization=0.6 of .* leaves no room for the KV cache"):
        r._num_blocks()
    r.spec.kv_cache_memory_gib = 1.0  # a size given in the config wins
    assert r._num_blocks() == GIB // per_block


def test_a_cpu_runner_is_sized_as_before():
    r = ModelRunner(ModelSpec("m", "tiny:qwen2-large", block_size=4, max_model_len=160),
                    build_tiny_model_dir("qwen2-large"))
    assert r.memory is None and r.num_blocks == GIB // r._block_bytes()


@pytest.mark.parametrize("graphs", [0, 16])
def test_the_profile_step_runs_the_largest_step_without_touching_the_real_cache(graphs):
    r = runner(attention_backend="torch")  # the CPU's graph stand-in takes a backend that captures
    if graphs:
        r.use_cuda_graphs(graphs, capture=False)
    greedy(r, prompts(3), steps=4)
    chunks = [Chunk([7], 20, list(range(i * 8, i * 8 + 8))) for i in range(3)]  # rewrites slot 20 alike each time
    want = r.run(chunks).logits
    before = r.kv_cache.clone()
    steps, graph = r.profile(graphs)
    assert steps.bytes == 0 and graph.bytes == 0  # nothing to measure on a CPU
    assert torch.equal(r.kv_cache, before)
    assert torch.equal(r.run(chunks).logits, want)  # and the runner steps on as if it had not run


def test_the_profile_step_covers_chunks_longer_than_a_step_of_decode_rows():
    r = runner(max_num_seqs=4, max_num_batched_tokens=300)
    calls = []
    forward = r._forward
    r._forward = lambda host, cache: calls.append((host.query_lens.tolist(), cache.shape[2])) or forward(host, cache)
    r.profile()
    assert calls == [([160, 47, 47, 46], 1), ([1, 1, 1, 1], 1)]  # on a one-block throwaway pool


def test_the_scheduler_limits_reach_every_model_spec():
    cfg = EngineConfig([ModelSpec("a", "s"), ModelSpec("b", "s", max_num_batched_tokens=8192)],
                       scheduler=SchedulerSpec(max_num_seqs=32, max_num_batched_tokens=4096))
    assert [(m.max_num_seqs, m.max_num_batched_tokens) for m in cfg.models] == [(32, 4096), (32, 8192)]
    with pytest.raises(ConfigError, match=r"models\[0\].max_num_batched_tokens: .* scheduler.max_num_batched_tokens"):
        EngineConfig([ModelSpec("a", "s", max_num_batched_tokens=1024)], scheduler=SchedulerSpec())
    with pytest.raises(ConfigError, match="max_num_seqs: must be an integer >= 0"):
        ModelSpec("a", "s", max_num_seqs=-1)
