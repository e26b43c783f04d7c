"""`bench runner` on a GPU: decode step time eager and as a CUDA graph, by batch and context, against transformers
on the same weights and against the floor of reading the weights and the KV cache once at the device's copy rate.

    python -m tokenrouter.bench runner --config config/gpu-check/qwen3-0.6b_8b-shapes.yaml --batch 1,16,64 \\
        --contexts 512,2048,4096 --json runner-gpu.json

NOTE: the KV cache holds zeros (no prefill): a decode step costs the same whatever its cached values, and this
keeps a 64 x 4096-token batch from costing minutes of prefill.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time

import torch

from tokenrouter.config import ModelSpec
from tokenrouter.engine.model_runner import Chunk, ModelRunner
from tokenrouter.models.sources import resolve_model_dir


def copy_rate(device: torch.device, mib: int = 1024, repeat: int = 10) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy (the floor's bandwidth)."""
    src = torch.empty(mib * 2**20 // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    return 2 * src.numel() * src.element_size() * repeat / (start.elapsed_time(end) / 1e3)


CATCH_UP_TOKENS = (8, 32)  # tokens per row of the timed catch-up steps (bench simulate prices longer rows from them)
VERIFY_TOKENS = 5  # tokens per row of the timed verifying steps (verify:every=4), eager and as CUDA graphs


def bench_cuda_model(spec: ModelSpec, batches: list[int], contexts: list[int], steps: int, with_hf: bool,
                     weights_bytes, rate: float, measured=None) -> list[dict]:
    """One row per (context, batch): our decode step and verifying step (rows of VERIFY_TOKENS tokens, a logit
    row each) eager and replayed from a graph, transformers at the smallest context, and the weights-plus-KV floor. `measured(rows)`, if given, is called with the rows so far after each
    row and each transformers figure (the runner rewrites its JSON then: a run stopped at a time limit keeps them)."""
    steps_total = steps + 2
    longest = max(contexts) + max(steps_total, max(CATCH_UP_TOKENS))
    per_seq = -(-longest // spec.block_size)
    spec = dataclasses.replace(spec, max_model_len=per_seq * spec.block_size, num_kv_blocks=max(batches) * per_seq,
                               kv_cache_memory_gib=0.0, cuda_graphs=True, cuda_graph_max_batch=max(batches),
                               cuda_graph_query_lens=[1, VERIFY_TOKENS],
                               max_num_batched_tokens=max(spec.max_num_batched_tokens, max(batches) * VERIFY_TOKENS))
    model_dir = resolve_model_dir(spec.source)
    runner = ModelRunner(spec, model_dir)
    cfg = runner.cfg
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * runner.kv_cache.element_size()
    weights = weights_bytes(runner)
    graphs, rows = runner.graphs, []
    for context in contexts:
        for b in batches:
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
            runner.graphs = None
            eager = decode_steps(runner, tables, context, steps)
            runner.graphs = graphs
            graph = decode_steps(runner, tables, context, steps) if graphs is not None else float("nan")
            if graphs is not None and context == min(contexts):
                agreement = graph_agreement(runner, graphs, tables, context, steps)
            floor = (weights + b * context * kv_token) / rate
            row = {"model": spec.name, "batch": b, "context": context, "eager_ms": eager * 1e3,
                   "graph_ms": graph * 1e3, "floor_ms": floor * 1e3, "graph_vs_floor": graph / floor,
                   "eager_vs_graph": eager / graph, "tok_s": b / min(eager, graph), "backend": runner.backend.name}
            if graphs is not None and context == min(contexts):
                row.update(agreement)
            verify = f"verify{VERIFY_TOKENS}"
            if graphs is not None:
                row[f"{verify}_graph_ms"] = catch_up_steps(runner, tables, context, VERIFY_TOKENS, steps, True) * 1e3
            runner.graphs = None  # catch-up steps of mixed lengths run eagerly in the engine
            row[f"{verify}_eager_ms"] = catch_up_steps(runner, tables, context, VERIFY_TOKENS, steps, True) * 1e3
            for n in CATCH_UP_TOKENS:
                row[f"catch_up{n}_ms"] = catch_up_steps(runner, tables, context, n, steps) * 1e3
            runner.graphs = graphs
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            if measured is not None:
                measured(rows)
    del runner, graphs
    gc.collect()
    torch.cuda.empty_cache()
    if with_hf:
        hf = load_hf_cuda(model_dir, spec)
        for row in rows:
            if row["context"] == min(contexts):
                row["hf_ms"] = decode_hf_cuda(hf, row["batch"], row["context"], steps) * 1e3
                print(json.dumps({"model": spec.name, "hf": True, "batch": row["batch"],
                                  "context": row["context"], "ms": round(row["hf_ms"], 3)}), flush=True)
                if measured is not None:
                    measured(rows)
        del hf
        gc.collect()
        torch.cuda.empty_cache()
    return rows


@torch.inference_mode()
def decode_steps(runner: ModelRunner, tables: list[list[int]], context: int, steps: int) -> float:
    """Median seconds of a decode step over `context` cached tokens, the step's tokens read back to the host (as
    the engine reads them); two warm-up steps first."""
    tokens = [1] * len(tables)
    times = []
    for step in range(steps + 2):
        chunks = [Chunk([t], context + step, table) for t, table in zip(tokens, tables)]
        t = time.perf_counter()
        tokens = runner.run(chunks).logits.argmax(-1).tolist()
        if step >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.inference_mode()
def catch_up_steps(runner: ModelRunner, tables: list[list[int]], context: int, tokens: int, steps: int,
                   verifying: bool = False) -> float:
    """Median seconds of a step whose every row computes `tokens` new tokens after `context` cached ones (a
    catch-up, as a sequence coming back from the other model brings; `verifying`: a logit row at every position,
    as the verifier's step of verify:every=k), its tokens read back; one warm-up."""
    chunks = [Chunk([1] * tokens, context, table, tokens if verifying else 1) for table in tables]
    times = []
    for step in range(steps + 1):
        t = time.perf_counter()
        runner.run(chunks).logits.argmax(-1).tolist()
        if step:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.inference_mode()
def graph_agreement(runner: ModelRunner, graphs, tables: list[list[int]], context: int, steps: int) -> dict:
    """How often a replayed step's greedy token equals the eager step's on the same inputs, and their largest
    logit difference: in bf16 padding to a bucket changes which GEMM kernels run, so tokens whose top two logits
    are closer than the step's rounding may differ (docs/gpu.md)."""
    tokens, same, total, diff = [1] * len(tables), 0, 0, 0.0
    for step in range(steps):
        chunks = [Chunk([t], context + step, table) for t, table in zip(tokens, tables)]
        runner.graphs = None
        eager = runner.run(chunks).logits
        runner.graphs = graphs
        graph = runner.run(chunks).logits
        a, b = eager.argmax(-1), graph.argmax(-1)
        same += int((a == b).sum())
        total += len(tables)
        diff = max(diff, float((eager - graph).abs().max()))
        tokens = a.tolist()
    return {"graph_token_agreement": same / total, "graph_max_logit_diff": diff}


def load_hf_cuda(model_dir, spec: ModelSpec):
    from tokenrouter.models.sources import transformers_model

    dtype = getattr(torch, spec.dtype if spec.dtype in ("bfloat16", "float16", "float32") else "bfloat16")
    return transformers_model(model_dir, dtype).to(spec.device)


@torch.inference_mode()
def decode_hf_cuda(model, batch: int, context: int, steps: int) -> float:
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache()
    model(input_ids=torch.ones(batch, context, dtype=torch.long, device=device), past_key_values=cache,
          use_cache=True, logits_to_keep=1)
    ids = torch.ones(batch, 1, dtype=torch.long, device=device)
    times = []
    for step in range(steps + 2):
        t = time.perf_counter()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        ids = out.logits[:, -1].argmax(-1, keepdim=True)
        ids.tolist()
        if step >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def print_cuda_table(rows: list[dict], rate: float) -> None:
    print(f"\ndevice copy rate {rate / 1e12:.2f} TB/s (read + written); floor = (weights streamed + KV read) / rate")
    print("| model | batch | context | eager ms | graph ms | eager / graph | floor ms | graph / floor | "
          "transformers ms | tok/s | graph tokens = eager (max logit diff) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        hf = f"{r['hf_ms']:.1f}" if "hf_ms" in r else "-"
        same = (f"{r['graph_token_agreement']:.1%} ({r['graph_max_logit_diff']:.3g})" if "graph_token_agreement" in r
                else "-")
        print(f"| {r['model']} | {r['batch']} | {r['context']} | {r['eager_ms']:.2f} | {r['graph_ms']:.2f} | "
              f"{r['eager_vs_graph']:.2f}x | {r['floor_ms']:.2f} | {r['graph_vs_floor']:.2f}x | {hf} | "
              f"{r['tok_s']:.0f} | {same} |")
    verify = f"verify{VERIFY_TOKENS}"
    print(f"\nverifying steps ({VERIFY_TOKENS} tokens and logit rows a sequence, verify:every={VERIFY_TOKENS - 1}): a "
          f"graph pays where eager / graph > 1; verifying pays where a verifying step costs little more than a decode "
          f"step")
    print("| model | batch | context | eager ms | graph ms | eager / graph | graph / decode graph |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        graph = r.get(f"{verify}_graph_ms", float("nan"))
        print(f"| {r['model']} | {r['batch']} | {r['context']} | {r[f'{verify}_eager_ms']:.2f} | {graph:.2f} | "
              f"{r[f'{verify}_eager_ms'] / graph:.2f}x | {graph / r['graph_ms']:.2f}x |")
