"""llama.cpp's batch-1 decode on a GGUF file (llama-cpp-python), in a child process of its own.

    python -m tokenrouter.bench.llamacpp FILE.gguf --prompt-len 32 --steps 8 --threads 2

NOTE: prompts are evaluated one token per call (n_batch=1): batched prompt evaluation in the llama-cpp-python
build of the embedded extra crashed (SIGSEGV in llama_decode) on an AVX-512 + AMX CPU, so `measure` runs this
in a subprocess and reports a crash as a crash instead of taking the benchmark down with it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def decode_ms(path: str, prompt_len: int, steps: int, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=prompt_len + steps + 8, n_batch=1, n_ubatch=1, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    start = time.perf_counter()
    llm.eval([1000 + i for i in range(prompt_len)])
    prefill = time.perf_counter() - start
    token, times = 1000, []
    for step in range(steps + 2):
        t = time.perf_counter()
        llm.eval([token])
        if step >= 2:
            times.append(time.perf_counter() - t)
        token = int(llm.scores[-1].argmax())
    return {"decode_ms": statistics.median(times) * 1e3, "prefill_tok_s": prompt_len / prefill, "threads": threads}


REPEATS = 3  # children per measurement: llama.cpp's decode time moved 55-71 ms between runs on one machine


def measure(path: str, prompt_len: int, steps: int, threads: int, timeout: float = 600,
            repeats: int = REPEATS) -> dict:
    """`decode_ms` in `repeats` child processes, one after another: the median run's, with every run's time in
    `decode_ms_runs`; or {"error": why} when none ran (not installed, crashed, timed out)."""
    return combine([_measure_once(path, prompt_len, steps, threads, timeout) for _ in range(repeats)])


def combine(runs: list[dict]) -> dict:
    """The runs that measured, summarised by their median decode time; the last error if none did."""
    ok = sorted((r for r in runs if "decode_ms" in r), key=lambda r: r["decode_ms"])
    if not ok:
        return runs[-1]
    middle = dict(ok[(len(ok) - 1) // 2])
    middle["decode_ms_runs"] = [r["decode_ms"] for r in runs if "decode_ms" in r]
    if len(ok) < len(runs):
        middle["failed_runs"] = len(runs) - len(ok)
    return middle


def _measure_once(path: str, prompt_len: int, steps: int, threads: int, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "tokenrouter.bench.llamacpp", str(path), "--prompt-len", str(prompt_len),
           "--steps", str(steps), "--threads", str(threads)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit status {done.returncode}: {tail}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenrouter.bench.llamacpp")
    p.add_argument("gguf")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed (pip install -e '.[llamacpp]'; pip compiles it from source, "
              "about 17 minutes on 2 cores)", file=sys.stderr)
        return 3
    print(json.dumps(decode_ms(args.gguf, args.prompt_len, args.steps, args.threads)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
