"""What `dtype: auto` may choose: the quantized dtypes whose greedy output agreed with fp32 on the calibration
prompts at least AGREEMENT_FLOOR of the time, measured by `python -m tokenrouter.bench runner --agreement`.

NOTE: agreement is a property of the weights and the kernels' arithmetic, not of the machine's speed, so it
is measured once and recorded here; a model not listed never gets a quantized dtype from `auto`. int4 has two
arithmetics: torch's int4 kernels (activations rounded to bf16 where that variant is faster) and our two-digit
kernels (activations kept to about 15 bits, tokenrouter/models/native.py): int4-vnni, which every int4
projection takes where it is built, and int4-avx2, which gives int4-vnni's floats bit for bit (the same integer
sums and fp32 operations in the same order; tests/models/test_native_avx2.py) and so shares its record. The
record of the arithmetic this machine runs counts. (int4-avx2 is timed against torch's int4 kernels per shape
and has not yet been measured winning every shape on an AVX2-only machine.)
"""
from __future__ import annotations

AGREEMENT_FLOOR = 0.97
# int4 kernels with the two-digit activations whose agreement "int4-vnni" records (int4-avx2 gives its floats
# bit for bit): where `auto` chose int4 on that record, its projections take one of these, never torch's int4
TWO_DIGIT_INT4 = ("int4-vnni", "int4-avx2")

# Greedy continuations of these, teacher-forced on the fp32 model's own tokens, are compared position by position.
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash map is in two sentences.",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"",
    "Write a function that merges two sorted lists into one sorted list.",
    "What is the difference between a list and a tuple in Python?",
    "Write a SQL query that returns the ten most recent orders.",
    "Implement binary search over a sorted array in Python.",
    "Write a bash one-liner that counts the lines of every .py file in a directory.",
]

# source -> {dtype: share of greedy positions equal to fp32}, measured (see docs/benchmarks.md, "Measured: the model runner")
# NOTE: 2026-12-04 02:57-03:06 UTC on a 2-core Intel Xeon (AVX-512, AVX512-BF16, AMX), torch 2.13.0+cpu,
# int8 / int4 through the int8-bf16 / int4-bf16 kernels (group 32, int4 fit "clip3"), 8 prompts x up to 32
# tokens (239 positions on the 0.5B, 256 on the 1.5B), by
#   python -m tokenrouter.bench runner --config config/embedded/qwen2.5-coder-0.5b_1.5b.yaml --models small \
#       --batch 1,4,16 --dtype float32,bfloat16,int8,int4 --agreement      (then --models large)
# int4 of the 0.5B misses the floor by one position (231/239; most of its GGUF groups are Q5_0 / Q8_0, which 4
# bits cannot hold); with the plain min/max int4 fit it was 224/239, and the 1.5B's int4 248/256 (02:16 UTC).
# "int4-vnni": int4 through the int4-vnni kernel (every projection), 2026-12-04 10:27-10:30 UTC, same machine
# and prompts, by `... --models large --batch 1,4,16 --dtype int4 --no-hf --agreement` (then --models small):
# 232/239 on the 0.5B, 250/256 on the 1.5B. Measured again 2026-12-05 08:00-08:16 UTC (same machine and command,
# `--batch 1`) after int4 took a GGUF's Q4_K blocks as its codes instead of fitting them: the same shares.
MEASURED: dict[str, dict[str, float]] = {
    "embedded:qwen2.5-coder-0.5b-instruct": {"bfloat16": 0.992, "int8": 0.983, "int4": 0.967, "int4-vnni": 0.971},
    "embedded:qwen2.5-coder-1.5b-instruct": {"bfloat16": 0.996, "int8": 0.988, "int4": 0.977, "int4-vnni": 0.977},
}


def auto_quantized(source: str, vnni: bool | None = None) -> str | None:
    """The smallest quantized dtype that agreed well enough with fp32 for `source`, or None. `vnni`: whether
    int4 runs on a two-digit kernel, int4-vnni or int4-avx2 (default: whether this machine can build one;
    nothing is built here)."""
    measured = MEASURED.get(source)
    if not measured:
        return None
    if vnni is None:
        vnni = two_digit_int4_built()
    shares = {"int4": measured.get("int4-vnni" if vnni else "int4", 0.0), "int8": measured.get("int8", 0.0)}
    return next((dtype for dtype, share in shares.items() if share >= AGREEMENT_FLOOR), None)


def two_digit_int4_built() -> bool:
    """Whether this machine can build a two-digit int4 kernel (TWO_DIGIT_INT4; nothing is built here)."""
    from tokenrouter.models import native
    return not native.int4_vnni_missing() or not native.avx2_missing()
