"""Routed generation in the terminal: tokens coloured by the model that wrote them, then the metrics.

    python -m tokenrouter.demo [--config PATH] [--policy confidence:threshold=0.9] [prompt ...]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import tokenrouter
from tokenrouter.service.output import RequestMetrics

ANSI = ["\033[34m", "\033[33;1m", "\033[32m", "\033[35m"]
RESET = "\033[0m"
DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences what a hash map is.",
]


async def show(svc, prompt: str, policy: str, max_tokens: int, colour: bool) -> None:
    paint = {m: ANSI[i % len(ANSI)] if colour else "" for i, m in enumerate(svc.models)}
    print(f"\n>>> {prompt}\n")
    records, t0 = [], time.perf_counter()
    async for r in svc.stream(prompt, policy=policy, max_tokens=max_tokens):
        records.append(r)
        print(f"{paint[r.model]}{r.text}{RESET if colour else ''}", end="", flush=True)
    m = RequestMetrics.from_records(records, svc.models, 0, {}, time.perf_counter() - t0)
    counts = ", ".join(f"{paint[k]}{k}{RESET if colour else ''} {v}" for k, v in m.tokens_per_model.items())
    print(f"\n\n[{len(records)} tokens ({counts}); large share {m.large_share:.0%}; TTFT {m.ttft * 1e3:.0f} ms; "
          f"TPOT {m.tpot * 1e3:.0f} ms; {len(records) / m.e2e:.1f} tokens/s]")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tokenrouter.demo", description=__doc__.splitlines()[0])
    p.add_argument("prompts", nargs="*", default=DEFAULT_PROMPTS)
    p.add_argument("--config", default="config/embedded/qwen2.5-coder-0.5b_1.5b.yaml")
    p.add_argument("--policy", default="confidence:threshold=0.9")
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    with tokenrouter.serve(args.config) as svc:
        print(f"[engine up in {time.perf_counter() - t0:.1f} s: {', '.join(svc.models)}; policy {args.policy}]")
        for prompt in args.prompts:
            asyncio.run(show(svc, prompt, args.policy, args.max_tokens, sys.stdout.isatty()))


if __name__ == "__main__":
    main()
