"""What `dtype: auto` may choose: the quantized dtypes whose greedy output agreed with fp32 on the calibration
prompts at least AGREEMENT_FLOOR of the time, measured by `python -m tokenrouter.bench runner --agreement`.

NOTE: agreement is a property of the weights and the kernels' arithmetic, not of the machine's speed, so it
is measured once and recorded here; a model not listed never gets a quantized dtype from `auto`.
"""
from __future__ import annotations

AGREEMENT_FLOOR = 0.97

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

# source -> {dtype: share of greedy positions equal to fp32}, measured (see README "Measured: the model runner")
# NOTE: 2026-12-04 02:57-03:06 UTC on a 2-core Intel Xeon (AVX-512, AVX512-BF16, AMX), torch 2.13.0+cpu,
# int8 / int4 through the int8-bf16 / int4-bf16 kernels (group 32, int4 fit "clip3"), 8 prompts x up to 32
# tokens (239 positions on the 0.5B, 256 on the 1.5B), by
#   python -m tokenrouter.bench runner --config config/embedded/qwen2.5-coder-0.5b_1.5b.yaml --models small \
#       --batch 1,4,16 --dtype float32,bfloat16,int8,int4 --agreement      (then --models large)
# int4 of the 0.5B misses the floor by one position (231/239; most of its GGUF groups are Q5_0 / Q8_0, which 4
# bits cannot hold); with the plain min/max int4 fit it was 224/239, and the 1.5B's int4 248/256 (02:16 UTC).
MEASURED: dict[str, dict[str, float]] = {
    "embedded:qwen2.5-coder-0.5b-instruct": {"bfloat16": 0.992, "int8": 0.983, "int4": 0.967},
    "embedded:qwen2.5-coder-1.5b-instruct": {"bfloat16": 0.996, "int8": 0.988, "int4": 0.977},
}


def auto_quantized(source: str) -> str | None:
    """The smallest quantized dtype that agreed well enough with fp32 for `source`, or None."""
    measured = MEASURED.get(source, {})
    for dtype in ("int4", "int8"):
        if measured.get(dtype, 0.0) >= AGREEMENT_FLOOR:
            return dtype
    return None
