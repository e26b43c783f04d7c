"""Decode speed of our model runner in each dtype against transformers and llama.cpp on the same weights,
beside the roofline, and how often each quantized dtype's greedy token equals fp32's.

    python -m tokenrouter.bench runner --config config/embedded/qwen2.5-coder-0.5b_1.5b.yaml --batch 1,4,16 \
        --dtype float32,bfloat16,int8,int4 --agreement

`--prefill 256,2048` also times a prompt of each length from an empty cache to its first logits (a first token's
compute, in chunks of the config's max_num_batched_tokens as the engine sends them), beside transformers'.

Models on a GPU are measured by tokenrouter/bench/runner_cuda.py instead: eager and CUDA-graph steps by batch and
context (--contexts) against the weights-plus-KV floor.
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
    p.add_argument("--contexts", default="512,2048,4096",
                   help="GPU models: comma-separated context lengths each decode step attends over")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per batch size")
    p.add_argument("--prefill", default="", help="CPU models: comma-separated prompt lengths to time a prefill of "
                   "(an empty cache to the first logits; best of 3), ours in each dtype and transformers")
    p.add_argument("--dtype", default="", help="comma-separated dtypes to measure each model in (float32, bfloat16, "
                   "int8, int4, auto; default: the config's)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp (batch-1 decode of the GGUF file)")
    p.add_argument("--agreement", action="store_true",
                   help="greedy agreement of each quantized dtype with fp32 on the calibration prompts")
    p.add_argument("--json", default="", help="write the results here")


def check_args(args: argparse.Namespace) -> None:
    """Every argument, before any model loads (raises ValueError naming the argument)."""
    cfg = checks.config(args.config)
    checks.levels(args.batch, "--batch")
    unknown = [n for n in model_names(args, cfg) if n not in {m.name for m in cfg.models}]
    if unknown:
        raise ValueError(f"--models: {unknown[0]!r} is not a model of {args.config}; it has "
                         f"{[m.name for m in cfg.models]}")
    bad = [d for d in dtypes(args) if d not in DTYPES]
    if bad:
        raise ValueError(f"--dtype: must be one of {DTYPES}, got {bad[0]!r}")
    checks.at_least(args.prompt_len, 1, "--prompt-len")
    checks.levels(args.contexts, "--contexts")
    checks.at_least(args.steps, 1, "--steps")
    if args.prefill:
        longest = max(checks.levels(args.prefill, "--prefill"))
        for name in model_names(args, cfg):
            if cfg.model(name).device.startswith("cuda"):
                raise ValueError(f"--prefill: times CPU models; {name} runs on {cfg.model(name).device}")
            if 0 < cfg.model(name).max_model_len < longest:
                raise ValueError(f"--prefill: {longest} tokens is more than {name}'s max_model_len "
                                 f"({cfg.model(name).max_model_len})")


def dtypes(args: argparse.Namespace) -> list[str]:
    return [d.strip() for d in args.dtype.split(",") if d.strip()]


def model_names(args: argparse.Namespace, cfg) -> list[str]:
    return [n.strip() for n in args.models.split(",") if n.strip()] or [m.name for m in cfg.models]


def run(args: argparse.Namespace) -> dict:
    cfg = load_config(args.config)
    batches = checks.levels(args.batch, "--batch")
    names = model_names(args, cfg)
    host = machine()
    torch.manual_seed(0)
    if any(cfg.model(n).device.startswith("cuda") for n in names):
        return run_cuda(args, cfg, names, batches, host)
    roofline = measure_roofline()
    print(f"roofline: fp32 GEMM {roofline['gemm_gflops']:.0f} GFLOP/s (MKL {roofline['gemm_mkl_gflops']:.0f}, "
          f"oneDNN {roofline['gemm_onednn_gflops']:.0f}), copy {roofline['copy_gbps']:.1f} GB/s, "
          f"read {roofline['read_gbps']:.1f} GB/s, {roofline['threads']} threads")
    rows, prefills, kernels, agreement = [], [], {}, {}
    lengths = tuple(checks.levels(args.prefill, "--prefill")) if args.prefill else ()
    for name in names:
        spec = cfg.model(name)
        specs = [dataclasses.replace(spec, dtype=d) for d in dtypes(args) or [spec.dtype]]
        model_rows, model_prefills, kernels[name] = bench_model(specs, batches, args.prompt_len, args.steps,
                                                                not args.no_hf, not args.no_llama_cpp, roofline,
                                                                lengths)
        rows += model_rows
        prefills += model_prefills
        if args.agreement:
            agreement[name] = measure_agreement(spec, [s.dtype for s in specs])
            print(json.dumps({"model": name, "agreement": agreement[name]}), flush=True)
    result = {"config": args.config, "roofline": roofline, "prompt_len": args.prompt_len, "steps": args.steps,
              "torch": torch.__version__, "machine": host, "results": rows, "prefill": prefills, "kernels": kernels,
              "agreement": agreement}
    print()
    announce(host)
    print_kernels(kernels)
    print_table(rows, agreement)
    print_prefill(prefills)
    write_json(args.json, result)
    return result


def run_cuda(args: argparse.Namespace, cfg, names: list[str], batches: list[int], host: dict) -> dict:
    from tokenrouter.bench import runner_cuda

    rate = runner_cuda.copy_rate(torch.device(cfg.model(names[0]).device))
    rows: list[dict] = []
    result = {"config": args.config, "copy_rate_bytes_s": rate, "steps": args.steps, "torch": torch.__version__,
              "machine": host, "results": rows}
    for name in names:
        done = len(rows)

        def measured(model_rows: list[dict], done: int = done) -> None:  # the JSON so far, as each row comes
            rows[done:] = model_rows
            write_json(args.json, result)

        rows[done:] = runner_cuda.bench_cuda_model(cfg.model(name), batches, checks.levels(args.contexts, "--contexts"),
                                                   args.steps, not args.no_hf, streamed_bytes, rate, measured)
    print()
    announce(host)
    runner_cuda.print_cuda_table(rows, rate)
    write_json(args.json, result)
    return result


def bench_model(specs: list[ModelSpec], batches: list[int], prompt_len: int, steps: int, with_hf: bool,
                with_llama_cpp: bool, roofline: dict,
                prefill: tuple[int, ...] = ()) -> tuple[list[dict], list[dict], dict]:
    """One row per batch size: at batch 1 llama.cpp on the GGUF file the weights came from, then each dtype's
    step time side by side, then transformers (fp32 weights); and one row per prompt length of `prefill`."""
    model_dir = resolve_model_dir(specs[0].source)
    prompts = {b: torch.randint(0, 100_000, (b, prompt_len), generator=torch.Generator().manual_seed(b)).tolist()
               for b in batches}
    rows = {b: {"model": specs[0].name, "batch": b, "ours": {}} for b in batches}
    long = {n: {"model": specs[0].name, "prompt": n, "ours": {}} for n in prefill}
    prompts_long = {n: torch.randint(0, 100_000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                    for n in prefill}
    kernels = {}
    # NOTE: llama.cpp first, while this process holds no model: measured after the runners and transformers,
    # its decode ran 15-20% slower in some runs (2026-12-04: 67.5 ms against 57-59 alone), cause not found
    gguf = gguf_file(specs[0].source) if with_llama_cpp and 1 in batches else None
    if gguf is not None:
        from tokenrouter.bench.llamacpp import measure
        found = measure(gguf, prompt_len, steps, torch.get_num_threads())
        rows[1]["llama_cpp"] = found
        print(json.dumps({"model": specs[0].name, "llama_cpp": found}), flush=True)
    for spec in specs:
        runner = ModelRunner(spec, model_dir)
        label = spec.dtype if spec.dtype == runner.weight_dtype else f"{spec.dtype}={runner.weight_dtype}"
        kernels[label] = {k: v["kernel"] for k, v in runner.kernels.used.items()} if runner.kernels else {}
        streamed = streamed_bytes(runner)
        for b in batches:
            step = median_step(lambda: decode_ours(runner, _fit(prompts[b], runner.cfg.vocab_size), steps))
            rows[b]["ours"][label] = {"ms": step * 1e3, "tok_s": b / step, "weights_gb": streamed / 1e9,
                                      "gbps": streamed / step / 1e9,
                                      "read_fraction": streamed / step / 1e9 / roofline["read_gbps"]}
            print(json.dumps({"model": spec.name, "dtype": label, "batch": b,
                              **{k: round(v, 3) for k, v in rows[b]["ours"][label].items()}}), flush=True)
        for n in prefill:
            prompt = _fit([prompts_long[n]], runner.cfg.vocab_size)[0]
            long[n]["ours"][label] = {"ms": min(prefill_ours(runner, prompt) for _ in range(3)) * 1e3}
            print(json.dumps({"model": spec.name, "dtype": label, "prompt": n,
                              "ms": round(long[n]["ours"][label]["ms"], 3)}), flush=True)
        del runner
        gc.collect()
    if with_hf:
        hf = load_hf(model_dir, torch.float32)
        for b in batches:
            theirs = median_step(lambda: decode_hf(hf, _fit(prompts[b], hf.config.vocab_size), steps))
            rows[b].update(hf_ms=theirs * 1e3, hf_tok_s=b / theirs)
            print(json.dumps({"model": specs[0].name, "hf": True, "batch": b, "ms": round(theirs * 1e3, 3)}), flush=True)
        for n in prefill:
            prompt = _fit([prompts_long[n]], hf.config.vocab_size)[0]
            long[n]["hf_ms"] = min(prefill_hf(hf, prompt) for _ in range(3)) * 1e3
            print(json.dumps({"model": specs[0].name, "hf": True, "prompt": n, "ms": round(long[n]["hf_ms"], 3)}),
                  flush=True)
        del hf
        gc.collect()
    return list(rows.values()), list(long.values()), kernels


def _fit(prompts: list[list[int]], vocab: int) -> list[list[int]]:
    return [[t % vocab for t in p] for p in prompts]


def gguf_file(source: str):
    """The GGUF file a model's weights were converted from (an embedded model's assembled file), if any."""
    from pathlib import Path
    if source.startswith("embedded:"):
        from tokenrouter.models.embedded import assemble, embedded_model
        return assemble(embedded_model(source))
    path = Path(source).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


@torch.inference_mode()
def measure_agreement(spec: ModelSpec, dtypes_: list[str]) -> dict[str, float]:
    """Share of positions where each quantized dtype's greedy token equals fp32's, over fp32's own greedy
    continuations of the calibration prompts (teacher-forced: one prefill per prompt and dtype); int4's under
    each arithmetic's calibration record (`arithmetics`)."""
    from transformers import AutoTokenizer

    from tokenrouter.engine.runtime import eos_token_ids
    from tokenrouter.generate import chat_prompt_ids, greedy
    from tokenrouter.models.calibration import MAX_TOKENS, PROMPTS

    model_dir = resolve_model_dir(spec.source)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stops = eos_token_ids(tokenizer)
    prompts = [chat_prompt_ids(tokenizer, p) for p in PROMPTS]
    runner = ModelRunner(dataclasses.replace(spec, dtype="float32"), model_dir)
    continuations = [list(greedy(runner, ids, MAX_TOKENS, stops)) for ids in prompts]
    del runner
    gc.collect()
    result = {}
    for dtype, record, kernels in arithmetics(spec, dtypes_):
        runner = ModelRunner(dataclasses.replace(spec, dtype=dtype), model_dir, kernels=kernels)
        if runner.weight_dtype == "float32":
            continue
        same = total = 0
        for ids, cont in zip(prompts, continuations):
            blocks, kv = BlockManager(runner.num_blocks, runner.block_size), KVState()
            tokens = ids + cont[:-1]  # the last len(cont) positions predict cont, one token each
            blocks.allocate(kv, len(tokens))
            predicted = runner.run([Chunk(tokens, 0, kv.block_table, len(cont))]).logits.argmax(-1).tolist()
            same += sum(p == e for p, e in zip(predicted, cont))
            total += len(cont)
        result[record or runner.weight_dtype] = same / max(1, total)
        print(json.dumps({"model": spec.name, "agreement": record or runner.weight_dtype, "same": same,
                          "positions": total}), flush=True)
        del runner
        gc.collect()
    return result


def arithmetics(spec: ModelSpec, dtypes_: list[str]) -> list[tuple[str, str, tuple[str, ...] | None]]:
    """(dtype, record, kernels) to measure for `dtypes_`: int4 once per arithmetic that runs here, by its
    calibration record (ours where they build, then torch's); others once, under their dtype."""
    from tokenrouter.models.calibration import OUR_INT4, TORCH_INT4, our_int4_built, record_of

    runs = []
    for dtype in dict.fromkeys(dtypes_):
        if dtype != "int4":
            runs.append((dtype, "", None))
        elif spec.kernel == "auto":
            ours = list(OUR_INT4.items()) if our_int4_built() else []
            runs += [("int4", record, kernels) for record, kernels in ours + [("int4", TORCH_INT4)]]
        else:  # the kernel the config names is the arithmetic
            runs.append(("int4", record_of(spec.kernel), None))
    return runs


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


@torch.inference_mode()
def prefill_ours(runner: ModelRunner, prompt: list[int]) -> float:
    """Seconds from an empty cache to the prompt's last logits and greedy token, in chunks of at most the config's
    max_num_batched_tokens, as the engine's scheduler sends a long prompt."""
    if len(prompt) > runner.max_model_len:
        raise ValueError(f"--prefill: {len(prompt)} tokens is more than {runner.spec.name}'s max_model_len "
                         f"({runner.max_model_len})")
    blocks, kv = BlockManager(runner.num_blocks, runner.block_size), KVState()
    blocks.allocate(kv, len(prompt))
    step = runner.limits.max_num_batched_tokens
    t = time.perf_counter()
    for start in range(0, len(prompt), step):
        out = runner.run([Chunk(prompt[start:start + step], start, kv.block_table)])
    out.logits.argmax(-1).tolist()
    seconds = time.perf_counter() - t
    blocks.free(kv)
    return seconds


@torch.inference_mode()
def prefill_hf(model, prompt: list[int]) -> float:
    t = time.perf_counter()
    model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1).tolist()
    return time.perf_counter() - t


def load_hf(model_dir, dtype: torch.dtype):
    from tokenrouter.models.sources import transformers_model
    return transformers_model(model_dir, dtype)


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


def print_kernels(kernels: dict) -> None:
    for model, by_dtype in kernels.items():
        for dtype, chosen in by_dtype.items():
            shapes = ", ".join(f"{key.split('|')[1]} {name}" for key, name in chosen.items())
            print(f"kernels {model} {dtype}: {shapes or 'default (not a CPU)'}")


def print_table(rows: list[dict], agreement: dict | None = None) -> None:
    labels = list(dict.fromkeys(label for r in rows for label in r["ours"]))
    head = " | ".join(f"{label} ms/step | {label} tok/s" for label in labels)
    print(f"\n| model | batch | {head} | HF fp32 ms/step | best vs HF | llama.cpp ms/token (median of runs, range) | best vs llama.cpp |")
    print("|---|---|" + "---|---|" * len(labels) + "---|---|---|---|")
    for r in rows:
        ours = " | ".join(f"{r['ours'][x]['ms']:.1f} | {r['ours'][x]['tok_s']:.1f}" if x in r["ours"] else "- | -"
                          for x in labels)
        best = min(v["ms"] for v in r["ours"].values())
        hf = f"{r['hf_ms']:.1f} | {r['hf_ms'] / best:.2f}x" if "hf_ms" in r else "- | -"
        lc = r.get("llama_cpp", {})
        runs = lc.get("decode_ms_runs", [])
        spread = f" ({min(runs):.1f}-{max(runs):.1f})" if len(runs) > 1 else ""
        llama = (f"{lc['decode_ms']:.1f}{spread} | {lc['decode_ms'] / best:.2f}x" if "decode_ms" in lc
                 else f"{lc['error']} | -" if "error" in lc else "- | -")
        print(f"| {r['model']} | {r['batch']} | {ours} | {hf} | {llama} |")
    for model, shares in (agreement or {}).items():
        text = ", ".join(f"{dtype} {share:.1%}" for dtype, share in shares.items())
        print(f"greedy agreement with fp32, {model}: {text}")


def print_prefill(rows: list[dict]) -> None:
    if not rows:
        return
    labels = list(dict.fromkeys(label for r in rows for label in r["ours"]))
    print("\nprefill, ms from an empty cache to the first token's logits (best of 3)")
    print(f"| model | prompt tokens | {' | '.join(labels)} | HF fp32 | best vs HF |")
    print("|---|---|" + "---|" * len(labels) + "---|---|")
    for r in rows:
        ours = " | ".join(f"{r['ours'][x]['ms']:.0f}" if x in r["ours"] else "-" for x in labels)
        best = min(v["ms"] for v in r["ours"].values())
        hf = f"{r['hf_ms']:.0f} | {r['hf_ms'] / best:.2f}x" if "hf_ms" in r else "- | -"
        print(f"| {r['model']} | {r['prompt']} | {ours} | {hf} |")
