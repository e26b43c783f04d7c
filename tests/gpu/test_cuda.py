"""CUDA checks, skipped without a GPU: runner logits against transformers in bf16, the flash backend against
the torch one, sampled requests, two models on two devices, and TP=2 over NCCL (the last two where the machine
has two GPUs); decode and verifying graphs and the Triton backend; the KV budget (the largest steps and the graphs stay within
gpu_memory_utilization, one model or two on one GPU). `tests/gpu/run.sh` runs these and a short `bench serve` on a
lent GPU machine."""
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
@pytest.mark.parametrize("pool", [dict(num_kv_blocks=64), dict(gpu_memory_utilization=0.5)])  # given, or sized
def test_tensor_parallel_over_nccl_matches_one_gpu(pool):
    """Sized from memory, the ranks agree on the pool any of them has room for (tokenrouter/engine/kv_budget.py)."""
    from tokenrouter.engine.worker_process import ProcessExecutor

    ref = logits("tiny:qwen2-large", device="cuda:0")
    spec = ModelSpec("m", "tiny:qwen2-large", tensor_parallel_size=2, devices=["cuda:0", "cuda:1"], **pool)
    tp = ProcessExecutor("m", ["m"], spec, resolve_model_dir(spec.source))
    try:
        tp.wait_ready()
        ours = torch.tensor(tp.call("prompt_logits", PROMPT))
    finally:
        tp.close()
    assert tp.info.num_blocks > 1 and (ours - ref).abs().max().item() < 1e-3


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


# ---- CUDA graphs and the Triton backend (issue: the engine at GPU speed) ------------------------------------
def cuda_runner(source: str = "tiny:qwen3", dtype: str = "float32", graphs: bool = True, backend: str = "auto"):
    from tokenrouter.engine.model_runner import ModelRunner

    spec = ModelSpec("m", source, device="cuda", dtype=dtype, block_size=16, num_kv_blocks=256, max_model_len=512,
                     cuda_graphs=graphs, cuda_graph_max_batch=16, attention_backend=backend,
                     cuda_graph_query_lens=[1, 5])
    return ModelRunner(spec, resolve_model_dir(source))


def decode_chunks(runner, rows: int, context: int = 24):
    """Prefill `rows` sequences of `context` tokens; a decode step over them (contexts of different lengths)."""
    from tokenrouter.engine.model_runner import Chunk

    tables = [list(range(i * 4, i * 4 + 4)) for i in range(rows)]
    runner.run([Chunk(PROMPT[:context - 2] + [7 + i % 3, 7], 0, t) for i, t in enumerate(tables)])
    return [Chunk([5 + i], context - i % 3, t) for i, t in enumerate(tables)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_the_eager_forward_on_the_same_padded_batch(dtype):
    runner = cuda_runner(dtype=dtype)
    assert runner.backend.name == "triton"
    assert sorted(runner.graphs.graphs) == [(q, b) for q in (1, 5) for b in (1, 2, 4, 8, 16)]
    from tokenrouter.engine.model_runner import Chunk
    from tokenrouter.engine.step_inputs import build_host_step

    decode = decode_chunks(runner, rows=3)
    verifying = [Chunk(c.token_ids + [9, 10, 11, 12], c.start, c.block_table, 5) for c in decode]
    for chunks, q in ((decode, 1), (verifying, 5)):
        host = build_host_step(chunks, 16, 512)  # bucket 4: one padded row
        # NOTE: the static buffers are inference tensors (made in use_cuda_graphs): written in place only in this mode
        with torch.inference_mode():
            replayed = runner.graphs.run(host)
            runner.graphs._fill(host, q, 4)
            eager = runner.graphs._forward(q, 4)[:3 * q]
        assert torch.equal(replayed, eager), q


def test_fp32_greedy_output_with_graphs_and_triton_equals_the_eager_torch_path():
    plain = [dict(m, cuda_graphs=False, attention_backend="torch") for m in PAIR_CUDA]
    verifying = {"name": "verify", "params": {"every": 3}}  # the large model captures its rows of 4 tokens too
    with tokenrouter.serve("config/tiny/pair.yaml", models=PAIR_CUDA, policy=verifying) as fast, \
            tokenrouter.serve("config/tiny/pair.yaml", models=plain) as slow:
        assert (4, 8) in fast.executors["large"].runner.graphs.graphs
        for policy in ("all-small", "random:share=0.3", "verify:every=3"):
            a = fast.generate_batch(PROMPTS, policy=policy, max_tokens=24, concurrency=8, ignore_eos=True)
            b = slow.generate_batch(PROMPTS, policy=policy, max_tokens=24, concurrency=8, ignore_eos=True)
            assert [o.token_ids for o in a] == [o.token_ids for o in b], policy


def test_bf16_graph_logits_agree_and_tokens_differ_only_at_near_ties():
    fast, slow = cuda_runner(dtype="bfloat16"), cuda_runner(dtype="bfloat16", graphs=False, backend="torch")
    for rows in (1, 3, 16):
        a, b = fast.run(decode_chunks(fast, rows)), slow.run(decode_chunks(slow, rows))
        assert (a.logits - b.logits).abs().max().item() <= 0.05 * b.logits.abs().max().item()
        top2 = b.logits.topk(2, -1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1 * top2[:, 0].abs().clamp(min=1)
        assert torch.equal(a.logits.argmax(-1)[clear], b.logits.argmax(-1)[clear])


@pytest.mark.parametrize("kind", ["neural", "probe"])
def test_capture_serves_the_policies_that_read_hidden_states(tmp_path, kind):
    from tokenrouter.policies.checkpoint import round_to_saved_precision, save_router
    from tokenrouter.policies.router_net import FEATURES, RouterNet
    from tokenrouter.policies.thresholds import score_quantiles

    torch.manual_seed(0)
    sizes = {"hidden": 64, "token_embedding": 64, "topk_logprobs": 4}  # tiny:qwen2-small's hidden size
    net = RouterNet({k: sizes[k] for k in FEATURES[kind]}, 16, 2)
    round_to_saved_precision(net)
    path = tmp_path / f"{kind}.pt"
    save_router(path, net, {"kind": kind, "threshold": 0.5, "pair": {"small": "tiny"},
                            "score_quantiles": score_quantiles(torch.linspace(0, 1, 101))})
    policy = f"{kind}:path={path},share=0.3"
    plain = [dict(m, cuda_graphs=False) for m in PAIR_CUDA]
    with tokenrouter.serve("config/tiny/pair.yaml", models=PAIR_CUDA) as fast, \
            tokenrouter.serve("config/tiny/pair.yaml", models=plain) as slow:
        a = fast.generate_batch(PROMPTS, policy=policy, max_tokens=16, concurrency=8, ignore_eos=True)
        b = slow.generate_batch(PROMPTS, policy=policy, max_tokens=16, concurrency=8, ignore_eos=True)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [[r.model for r in o.tokens] for o in a] == [[r.model for r in o.tokens] for o in b]
    assert 0 < sum(r.model == "large" for o in a for r in o.tokens) < sum(len(o.tokens) for o in a)


# ---- the KV budget: the largest step's activations and the graphs within gpu_memory_utilization ---------------------
SHAPED = "tiny:qwen3-0.6b-shape"  # Qwen3-0.6B's shapes and 151,936-token vocabulary: a large step's logits count
BUDGETED = dict(device="cuda", dtype="bfloat16", block_size=16, max_model_len=8192, max_num_seqs=64,
                max_num_batched_tokens=8192, gpu_memory_utilization=0.9)


def budgeted_runner(name: str = "m", **spec):
    from tokenrouter.engine.model_runner import ModelRunner

    return ModelRunner(ModelSpec(name, SHAPED, **{**BUDGETED, **spec}), resolve_model_dir(SHAPED))


def run_largest_steps(runner) -> None:
    """On the runner's real cache: the largest prefill (a max_model_len chunk, logits for every token), the profile's
    largest mixed step, and the largest decode step replayed and eager. Rows share blocks: values do not matter."""
    from tokenrouter.engine.model_runner import Chunk

    table = [b % runner.num_blocks for b in range(-(-runner.max_model_len // runner.block_size))]
    runner.run([Chunk([1] * runner.max_model_len, 0, table, runner.max_model_len)])
    runner.run([Chunk([1] * n, start, table, n) for n, start in runner.limits.largest_step()])
    decode = [Chunk([1], start, table) for _, start in runner.limits.largest_decode()]
    runner.run(decode)
    graphs, runner.graphs = runner.graphs, None
    runner.run(decode)
    runner.graphs = graphs
    torch.cuda.synchronize()


def fresh_device() -> int:
    """Free what earlier tests left; the device's total bytes."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[1]


def after_largest_steps(*runners) -> tuple[int, int]:
    """Torch's peak reservation and all in use on the device after each runner's largest steps."""
    from tokenrouter.engine.kv_budget import in_use

    for runner in runners:
        run_largest_steps(runner)
    # NOTE: the last profile step reset the peak statistics, so the peak covers the pools, the graphs and these steps
    return torch.cuda.max_memory_reserved(), in_use(torch.device("cuda:0"))


def assert_within(total: int, peak: int, now: int, utilization: float = 0.9) -> None:
    from tokenrouter.engine.kv_budget import gib

    assert peak <= utilization * total, f"torch reserved {gib(peak)} GiB at its peak of {gib(total)} GiB"
    # everything on the device, the CUDA context and kernels included (256 MiB: kernels loaded after the profile)
    assert now <= utilization * total + 2**28, f"{gib(now)} GiB in use of {gib(total)} GiB"


# NOTE: each test drops its runners before asserting: a failed assertion's traceback would keep their pools alive
def test_the_kv_pool_leaves_room_for_the_largest_steps_and_the_graphs():
    total = fresh_device()
    runner = budgeted_runner()
    memory, graphs, blocks = runner.memory, runner.graphs is not None, runner.num_blocks
    peak, now = after_largest_steps(runner)
    del runner
    assert memory.activations > 8192 * 151_936 * 4  # at least the logits of every token of the largest step, fp32
    assert graphs and memory.graphs > 0 and blocks > 512
    assert_within(total, peak, now)


def test_two_models_on_one_gpu_size_their_pools_from_what_is_left():
    """Local placement: the first model's pool given, the second sized from what is left; both step in turn."""
    from tokenrouter.engine.kv_budget import GIB

    total = fresh_device()
    small = budgeted_runner("small", kv_cache_memory_gib=2.0)
    large = budgeted_runner("large")
    first, second, weights = small.memory, large.memory, large.weight_bytes
    peak, now = after_largest_steps(small, large, small)
    del small, large
    assert second.in_use >= first.in_use + 2 * GIB + weights  # the first model's pool counted as in use
    assert second.activations >= first.activations  # room for the larger of the two, once
    assert_within(total, peak, now)


def test_a_model_sized_after_one_that_took_the_device_finds_no_room():
    fresh_device()
    first = budgeted_runner("first", max_num_batched_tokens=512, cuda_graphs=False)
    try:
        with pytest.raises(ValueError, match="second: gpu_memory_utilization=0.9 of .* leaves no room for the KV cache"):
            budgeted_runner("second", max_num_batched_tokens=512, cuda_graphs=False)
    finally:
        del first
