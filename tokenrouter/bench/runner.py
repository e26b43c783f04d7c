"""Decode speed of our model runner against transformers on the same weights, beside the roofline.

    python -m tokenrouter.bench runner --config config/embedded/qwen2.5-coder-0.5b_1.5b.yaml --batch 1,4,16
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time

import torch

from tokenrouter.bench import checks, write_json
from tokenrouter.bench.machine import announce, machine
from tokenrouter.bench.roofline import measure_roofline
from tokenrouter.config import DTYPES, ModelSpec, load_config
from tokenrouter.engine.block_manager import BlockManager, KVState
from tokenrouter.engine.model_runner import Chunk, ModelRunner
from tokenrouter.models.sources import resolve_model_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True)
    p.add_argument("--batch", default="1,4,16", help="comma-separated batch sizes")
    p.add_argument("--models", default="", help="comma-separated model names (default: all in the config)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per batch size")
    p.add_argument("--dtype", default="", help="override every model's dtype (float32, bfloat16, ...)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    p.add_argument("--json", default="", help="write the results here")


def check_args(args: argparse.Namespace) -> None:
    """Every argument, before any model loads (raises ValueError naming the argument)."""
    cfg = checks.config(args.config)
    checks.levels(args.batch, "--batch")
    unknown = [n for n in model_names(args, cfg) if n not in {m.name for m in cfg.models}]
    if unknown:
        raise ValueError(f"--models: {unknown[0]!r} is not a model of {args.config}; it has "
                         f"{[m.name for m in cfg.models]}")
    if args.dtype and args.dtype not in DTYPES:
        raise ValueError(f"--dtype: must be one of {DTYPES}, got {args.dtype!r}")
    checks.at_least(args.prompt_len, 1, "--prompt-len")
    checks.at_least(args.steps, 1, "--steps")


def model_names(args: argparse.Namespace, cfg) -> list[str]:
    return [n.strip() for n in args.models.split(",") if n.strip()] or [m.name for m in cfg.models]


def run(args: argparse.Namespace) -> dict:
    cfg = load_config(args.config)
    if args.dtype:
        cfg.models = [dataclasses.replace(m, dtype=args.dtype) for m in cfg.models]
    batches = checks.levels(args.batch, "--batch")
    names = model_names(args, cfg)
    host = machine()
    torch.manual_seed(0)
    roofline = measure_roofline()
    print(f"roofline: fp32 GEMM {roofline['gemm_gflops']:.0f} GFLOP/s (MKL {roofline['gemm_mkl_gflops']:.0f}, "
          f"oneDNN {roofline['gemm_onednn_gflops']:.0f}), copy {roofline['copy_gbps']:.1f} GB/s, "
          f"read {roofline['read_gbps']:.1f} GB/s, {roofline['threads']} threads")
    rows = []
    for name in names:
        spec = cfg.model(name)
        rows += bench_model(spec, batches, args.prompt_len, args.steps, not args.no_hf, roofline)
    result = {"config": args.config, "roofline": roofline, "prompt_len": args.prompt_len, "steps": args.steps,
              "torch": torch.__version__, "machine": host, "results": rows}
    print()
    announce(host)
    print_table(rows)
    write_json(args.json, result)
    return result


def bench_model(spec: ModelSpec, batches: list[int], prompt_len: int, steps: int, with_hf: bool,
                roofline: dict) -> list[dict]:
    model_dir = resolve_model_dir(spec.source)
    runner = ModelRunner(spec, model_dir)
    streamed = streamed_bytes(runner)
    hf = load_hf(model_dir, runner.dtype) if with_hf else None
    rows = []
    for batch in batches:
        prompts = torch.randint(0, runner.cfg.vocab_size, (batch, prompt_len)).tolist()
        ours = median_step(lambda: decode_ours(runner, prompts, steps))
        row = {"model": spec.name, "dtype": spec.dtype, "batch": batch, "ours_ms": ours * 1e3, "ours_tok_s": batch / ours,
               "weights_gb": streamed / 1e9,
               "ours_gbps": streamed / ours / 1e9,
               "copy_fraction": streamed / ours / 1e9 / roofline["copy_gbps"],
               "read_fraction": streamed / ours / 1e9 / roofline["read_gbps"]}
        if hf is not None:
            theirs = median_step(lambda: decode_hf(hf, prompts, steps))
            row.update(hf_ms=theirs * 1e3, hf_tok_s=batch / theirs, speedup=theirs / ours)
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    del runner, hf
    gc.collect()
    return rows


def streamed_bytes(runner: ModelRunner) -> int:
    """Bytes of weights a decode step reads: all of them except the embedding table, unless tied."""
    embed = runner.model.embed_tokens.weight
    untied = 0 if runner.cfg.tie_word_embeddings else embed.numel() * embed.element_size()
    return runner.weight_bytes - untied


def median_step(fn) -> float:
    return statistics.median(fn())


@torch.inference_mode()
def decode_ours(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[float]:
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    kvs = [KVState() for _ in prompts]
    tokens = [list(p) for p in prompts]
    times = []
    for step in range(steps + 2):
        chunks = []
        for kv, toks in zip(kvs, tokens):
            blocks.allocate(kv, len(toks))
            chunks.append(Chunk(toks[kv.num_cached:], kv.num_cached, kv.block_table))
        t = time.perf_counter()
        out = runner.run(chunks)
        next_ids = out.logits.argmax(-1).tolist()
        if step >= 2:  # the first step is the prefill, the second a warm-up decode
            times.append(time.perf_counter() - t)
        for kv, toks, nxt in zip(kvs, tokens, next_ids):
            kv.num_cached = len(toks)
            toks.append(nxt)
    for kv in kvs:
        blocks.free(kv)
    return times


def load_hf(model_dir, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@torch.inference_mode()
def decode_hf(model, prompts: list[list[int]], steps: int) -> list[float]:
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor(prompts)
    times = []
    for step in range(steps + 2):
        t = time.perf_counter()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        ids = out.logits[:, -1].argmax(-1, keepdim=True)
        if step >= 2:
            times.append(time.perf_counter() - t)
    return times


def print_table(rows: list[dict]) -> None:
    print("\n| model | batch | ours ms/step | ours tok/s | HF ms/step | HF tok/s | speedup | weights GB/s "
          "| of copy GB/s | of read GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        hf = (f"{r['hf_ms']:.0f} | {r['hf_tok_s']:.1f} | {r['speedup']:.2f}x" if "hf_ms" in r else "- | - | -")
        print(f"| {r['model']} | {r['batch']} | {r['ours_ms']:.0f} | {r['ours_tok_s']:.1f} | {hf} | "
              f"{r['ours_gbps']:.1f} | {r['copy_fraction']:.0%} | {r['read_fraction']:.0%} |")
