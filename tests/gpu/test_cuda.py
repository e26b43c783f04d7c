"""CUDA checks, skipped without a GPU: runner logits against transformers in bf16, the flash backend against
the torch one, sampled requests, two models on two devices, and TP=2 over NCCL (the last two where the machine
has two GPUs). `tests/gpu/run.sh` runs these and a short `bench serve` on a lent GPU machine."""
from __future__ import annotations

import pytest
import torch

import tokenrouter
from tokenrouter.config import ModelSpec
from tokenrouter.engine.worker import Worker
from tokenrouter.models.attention import flash_available
from tokenrouter.models.sources import resolve_model_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
PROMPT = list(range(3, 90, 3))
PAIR_CUDA = [{"name": "small", "source": "tiny:qwen2-small", "device": "cuda", "block_size": 16, "num_kv_blocks": 256},
             {"name": "large", "source": "tiny:qwen2-large", "device": "cuda", "block_size": 16, "num_kv_blocks": 256}]


def logits(source: str, **spec) -> torch.Tensor:
    worker = Worker("m", ["m"], ModelSpec("m", source, num_kv_blocks=64, **spec), resolve_model_dir(source))
    return torch.tensor(worker.prompt_logits(PROMPT))


@pytest.mark.parametrize("source", ["tiny:llama", "tiny:qwen2", "tiny:qwen3"])
def test_runner_logits_match_transformers_in_bf16(source):
    from transformers import AutoModelForCausalLM

    ours = logits(source, device="cuda", dtype="bfloat16", attention_backend="torch")
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(source), dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT], device="cuda")).logits[0].float().cpu()
    assert (ours - ref).abs().max().item() <= 0.05 * ref.abs().max().item()


@pytest.mark.skipif(not flash_available("cuda"), reason="needs flash-attn")
def test_flash_backend_matches_torch_backend():
    flash = logits("tiny:qwen3", device="cuda", dtype="bfloat16", block_size=256, attention_backend="flash")
    plain = logits("tiny:qwen3", device="cuda", dtype="bfloat16", block_size=256, attention_backend="torch")
    assert (flash - plain).abs().max().item() <= 0.05 * plain.abs().max().item()


def test_flash_refuses_float32():
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        logits("tiny:qwen3", device="cuda", dtype="float32", block_size=256, attention_backend="flash")


def test_sampled_requests_run_on_cuda_and_follow_their_seed():
    with tokenrouter.serve("config/tiny/pair.yaml", models=PAIR_CUDA) as svc:
        kwargs = dict(policy="random:share=0.3", max_tokens=16, temperature=0.8, top_p=0.9, seed=5)
        a = svc.generate("hello", **kwargs)
        batch = svc.generate_batch(["hello", "other prompt", "third"], concurrency=3, **kwargs)
    assert a.finish_reason == "length" and a.token_ids == batch[0].token_ids


def test_kv_pool_is_sized_from_free_memory():
    spec = ModelSpec("m", "tiny:qwen3", device="cuda", gpu_memory_utilization=0.5)
    worker = Worker("m", ["m"], spec, resolve_model_dir(spec.source))
    free, total = torch.cuda.mem_get_info()
    assert worker.runner.num_blocks > 1 and torch.cuda.memory_allocated() <= 0.5 * total


@TWO_GPUS
def test_two_models_on_two_devices_write_what_one_device_writes():
    two = [dict(PAIR_CUDA[0], device="cuda:0"), dict(PAIR_CUDA[1], device="cuda:1")]
    with tokenrouter.serve("config/tiny/pair.yaml", models=PAIR_CUDA) as one, \
            tokenrouter.serve("config/tiny/pair.yaml", models=two, placement="process") as split:
        for policy in ("schedule:every=3", "random:share=0.3"):
            a = one.generate_batch(["hello", "def f(x):"], policy=policy, max_tokens=12)
            b = split.generate_batch(["hello", "def f(x):"], policy=policy, max_tokens=12)
            assert [o.token_ids for o in a] == [o.token_ids for o in b]


@TWO_GPUS
def test_tensor_parallel_over_nccl_matches_one_gpu():
    from tokenrouter.engine.worker_process import ProcessExecutor

    ref = logits("tiny:qwen2-large", device="cuda:0")
    spec = ModelSpec("m", "tiny:qwen2-large", num_kv_blocks=64, tensor_parallel_size=2, devices=["cuda:0", "cuda:1"])
    tp = ProcessExecutor("m", ["m"], spec, resolve_model_dir(spec.source))
    try:
        tp.wait_ready()
        ours = torch.tensor(tp.call("prompt_logits", PROMPT))
    finally:
        tp.close()
    assert (ours - ref).abs().max().item() < 1e-3


PROMPTS = ["def add(a, b):", "hello", "The quick brown fox", "x" * 40, "Once upon a time", "import os\n",
           "Q: 2+2?", "SELECT * FROM t WHERE"]


def test_verification_on_cuda_writes_all_large_greedy_and_sampled():
    """Rollback, the verifier's multi-position logits and the CPU-drawn sampling noise moved to the GPU: on CUDA,
    verify:every=k writes all-large's tokens, greedy at C=1 and 8 and sampled with the same seed."""
    with tokenrouter.serve("config/tiny/pair.yaml", models=PAIR_CUDA) as svc:  # fp32, the default dtype
        for k, concurrency in ((1, 1), (4, 1), (4, 8)):
            large = svc.generate_batch(PROMPTS, concurrency=concurrency, policy="all-large", max_tokens=16)
            verified = svc.generate_batch(PROMPTS, concurrency=concurrency, policy=f"verify:every={k}", max_tokens=16)
            assert [o.token_ids for o in verified] == [o.token_ids for o in large]
            assert sum(o.metrics.drafted for o in verified) > 0
        kwargs = dict(max_tokens=12, temperature=0.8, top_k=8, seed=11, ignore_eos=True)
        for prompt in PROMPTS[:3]:
            assert svc.generate(prompt, policy="verify:every=2", **kwargs).token_ids == \
                   svc.generate(prompt, policy="all-large", **kwargs).token_ids
        for name, s in svc.stats().items():
            if name != "active_requests":
                assert s["free_blocks"] == s["total_blocks"], (name, s)


def test_process_placement_on_one_gpu_writes_what_local_writes():
    """Each model in its own process on the same GPU (CUDA initialised in a fresh interpreter, not a fork)."""
    with tokenrouter.serve("config/tiny/pair.yaml", models=PAIR_CUDA) as local, \
            tokenrouter.serve("config/tiny/pair.yaml", models=PAIR_CUDA, placement="process") as split:
        for policy in ("schedule:every=3", "verify:every=4"):
            a = local.generate_batch(PROMPTS[:4], policy=policy, max_tokens=12, concurrency=4)
            b = split.generate_batch(PROMPTS[:4], policy=policy, max_tokens=12, concurrency=4)
            assert [o.token_ids for o in a] == [o.token_ids for o in b]
