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
MEASURED: dict[str, dict[str, float]] = {}


def auto_quantized(source: str) -> str | None:
    """The smallest quantized dtype that agreed well enough with fp32 for `source`, or None."""
    measured = MEASURED.get(source, {})
    for dtype in ("int4", "int8"):
        if measured.get(dtype, 0.0) >= AGREEMENT_FLOOR:
            return dtype
    return None
