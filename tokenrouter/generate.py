"""Plain greedy generation with one model of a config, streamed to the terminal.

    python -m tokenrouter.generate --config config/embedded/qwen2.5-coder-0.5b_1.5b.yaml --model small "prompt"
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator

from tokenrouter.config import ModelSpec, default_config, load_config
from tokenrouter.engine.block_manager import BlockManager, KVState
from tokenrouter.engine.model_runner import Chunk, ModelRunner
from tokenrouter.engine.runtime import eos_token_ids
from tokenrouter.models.sources import resolve_model_dir


def load(spec: ModelSpec):
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(spec.source)
    return ModelRunner(spec, model_dir), AutoTokenizer.from_pretrained(model_dir)


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def greedy(runner: ModelRunner, prompt_ids: list[int], max_tokens: int, stop_ids: set[int]) -> Iterator[int]:
    """Greedy decoding of one sequence on the paged cache; yields each new token id."""
    blocks = BlockManager(runner.num_blocks, runner.block_size)
    kv, tokens = KVState(), list(prompt_ids)
    try:
        for _ in range(max_tokens):
            blocks.allocate(kv, len(tokens))
            out = runner.run([Chunk(tokens[kv.num_cached:], kv.num_cached, kv.block_table)])
            kv.num_cached = len(tokens)
            token = int(out.logits[0].argmax())
            yield token
            if token in stop_ids:
                return
            tokens.append(token)
    finally:
        blocks.free(kv)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tokenrouter.generate", description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--config", default=default_config())
    p.add_argument("--model", default="", help="model name in the config (default: the first)")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    spec = cfg.model(args.model) if args.model else cfg.models[0]
    t0 = time.perf_counter()
    runner, tokenizer = load(spec)
    print(f"[{spec.name}: {spec.source} loaded in {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    prompt_ids = chat_prompt_ids(tokenizer, args.prompt)
    stops = eos_token_ids(tokenizer)
    t0, ids, shown = time.perf_counter(), [], ""
    for token in greedy(runner, prompt_ids, args.max_tokens, stops):
        if token in stops:
            break
        ids.append(token)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        print(text[len(shown):], end="", flush=True)
        shown = text
    dt = time.perf_counter() - t0
    print(f"\n[{len(ids)} tokens in {dt:.1f} s, {len(ids) / dt:.1f} tokens/s]", file=sys.stderr)


if __name__ == "__main__":
    main()
