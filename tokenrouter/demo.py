"""Routed generation in the terminal: tokens coloured by the model that wrote them, then the metrics.

    python -m tokenrouter.demo [--config PATH] [--policy confidence:threshold=0.9] [--max-tokens 512] [prompt ...]

The same engine and defaults as the Gradio app (`python -m app`), without a browser.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time

import tokenrouter
from tokenrouter.bench import checks
from tokenrouter.config import default_config

# NOTE: measured on the project's own coding tasks: the 24 held-out answers of the pilot's token-level run
# (notebook 02, max 512) all ended by themselves, in 78-313 tokens (median 162); 96 would cut 22 of 24 off.
DEFAULT_MAX_TOKENS = 512  # the app's default too (app/controls.py)
DEFAULT_POLICY = "confidence:threshold=0.9"
ANSI = ["\033[34m", "\033[33;1m", "\033[32m", "\033[35m"]
RESET = "\033[0m"
DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences what a hash map is.",
]


async def show(svc, prompt: str, policy: str, max_tokens: int, colour: bool) -> None:
    paint = {m: ANSI[i % len(ANSI)] if colour else "" for i, m in enumerate(svc.models)}
    end = RESET if colour else ""
    print(f"\n>>> {prompt}\n")
    stream = svc.stream(prompt, policy=policy, max_tokens=max_tokens)
    async for r in stream:
        print(f"{paint[r.model]}{r.text}{end}", end="", flush=True)
    out = stream.output
    m = out.metrics
    counts = ", ".join(f"{paint[k]}{k}{end} {v}" for k, v in m.tokens_per_model.items())
    cut = f"; cut at --max-tokens {max_tokens}" if out.finish_reason == "length" else ""
    print(f"\n\n[{len(out.tokens)} tokens ({counts}); large share {m.large_share:.0%}; hand-offs {m.handoffs}; "
          f"TTFT {m.ttft * 1e3:.0f} ms; TPOT {m.tpot * 1e3:.0f} ms; {len(out.tokens) / m.e2e:.1f} tokens/s; "
          f"finish {out.finish_reason}{cut}]")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tokenrouter.demo", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("prompts", nargs="*", default=DEFAULT_PROMPTS, metavar="prompt",
                   help="prompts to answer one after another, each sent as a user chat message")
    p.add_argument("--config", default=default_config(),
                   help="engine config (YAML) naming the models; the first model is the small one")
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help="routing policy spec, name:key=value,... (e.g. all-small, random:share=0.15, "
                        "verify:every=4; docs/policies.md lists them)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="most tokens per answer (the app's default; an answer cut here says so)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """The config, the policy and max_tokens, before the engine loads (raises ValueError naming the argument)."""
    checks.config(args.config)
    checks.policies([args.policy], "--policy")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens: must be >= 1, got {args.max_tokens}")


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    checks.before_work(p, check_args, args)
    t0 = time.perf_counter()
    with tokenrouter.serve(args.config) as svc:
        print(f"[engine up in {time.perf_counter() - t0:.1f} s: {', '.join(svc.models)}; policy {args.policy}]")
        for prompt in args.prompts:
            asyncio.run(show(svc, prompt, args.policy, args.max_tokens, sys.stdout.isatty()))


if __name__ == "__main__":
    main()
