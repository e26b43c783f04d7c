"""What `dtype: auto` may choose: the quantized dtypes whose greedy agreement with fp32 on the calibration
prompts was at least AGREEMENT_FLOOR, measured by `python -m tokenrouter.bench runner --agreement`.

NOTE: agreement is a property of the weights and the kernels' arithmetic, not of the machine's speed, so it
is measured once and recorded here; a model not listed never gets a quantized dtype from `auto`. int4 has three
arithmetics, each with its own record: torch's int4 kernels ("int4": activations rounded to bf16 where that
variant is faster), and two of ours (tokenrouter/models/native.py), the activations split per 32 columns into
two int8 digits, about 15 bits ("int4-vnni": int4-vnni, int4-avx2, int4-avxvnni), or one, about 8 ("int4-a8":
int4-vnni-a8, int4-avx2-a8, int4-avxvnni-a8: half the integer dot products). The kernels of one arithmetic give
the same floats bit for bit (the same integer sums and fp32 operations in the same order;
tests/models/test_native_avx2.py, test_native_avxvnni.py), so share its record. Where our kernels build, `auto`
takes the fastest of ours whose record reaches the floor and binds the model's int4 projections to its kernels;
int8 where none does. int8 has one record: our int8 kernels (int8-vnni, int8-avx2, int8-avxvnni: the same floats)
keep about 15 bits of each activation, torch's take bf16 or fp32 ones.
"""
from __future__ import annotations

from typing import NamedTuple

AGREEMENT_FLOOR = 0.97
# our int4 arithmetics by record, fastest first: the kernels that give each one's floats
OUR_INT4 = {"int4-a8": ("int4-vnni-a8", "int4-avx2-a8", "int4-avxvnni-a8"),
            "int4-vnni": ("int4-vnni", "int4-avx2", "int4-avxvnni")}
# torch's int4 kernels (the "int4" record)
TORCH_INT4 = ("int4-bf16", "int4-fp32")

# Greedy continuations of these (up to MAX_TOKENS each), teacher-forced on the fp32 model's own tokens, are
# compared position by position.
# NOTE: 32 tokens a prompt until 2026-12-06 (239 / 256 positions): one position moved a share by 0.4%, and
# int4-a8 on the 1.5B went from 249 to 248 of 256 (97.3 -> 96.9%, across the floor) with a change in fp32
# rounding alone; 128 tokens give about four times the positions.
MAX_TOKENS = 128
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

# source -> {dtype or int4 record: share of greedy positions equal to fp32}, measured (see docs/benchmarks.md,
# "Measured: the model runner")
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
# "int4-a8": int4 through int4-vnni-a8 (every int4 projection), 2026-12-06 16:49-16:54 UTC on a 2-core AMD EPYC
# (Zen 4, AVX-512 VNNI), same prompts: 249/256 on the 1.5B, 231/239 on the 0.5B (below the floor: it keeps two
# digits). Again 18:20-18:27 UTC by `... --models large --dtype int4 --batch 1 --no-hf --no-llama-cpp --agreement`
# (then --models small), which measures each int4 arithmetic: int4-a8 / int4-vnni / torch's int4 97.3 / 97.7 /
# 97.7% on the 1.5B, 96.7 / 97.1 / 96.2% on the 0.5B (torch's picks bf16 or fp32 activations per shape by timing,
# so its share moves with the machine: 96.7% on the Xeon; below the floor on both).
# Our kernels in groups of sixteen rows (each block's integer dot product scaled once, where the groups of four
# summed four partial lanes in fp32), 2026-12-06 20:31-20:35 UTC on the AMD EPYC, the same command: int4-a8 /
# int4-vnni 96.9 / 97.7% on the 1.5B (248/256: one position below the floor), 97.1 / 97.1% on the 0.5B (232/239).
# One position moved a decision each way, so the continuations grew to MAX_TOKENS = 128 and every record below
# was measured again on them, 2026-12-06 20:50-21:08 UTC on a 2-core AMD EPYC (Zen 4: AVX-512 VNNI and BF16, no
# AMX), torch 2.13.0+cpu, by
#   python -m tokenrouter.bench runner --config config/embedded/qwen2.5-coder-0.5b_1.5b.yaml --models large \
#       --dtype float32,bfloat16,int8,int4 --batch 1 --no-hf --no-llama-cpp --agreement      (then --models small)
# bf16 through oneDNN, int8 through int8-avx2 (chosen by timing here), int4 through each arithmetic's kernels:
#   1.5B, 905 positions: bf16 899, int8 898, int4-a8 884 (97.7%), int4-vnni 892, torch's int4 891;
#   0.5B, 751 positions: bf16 747, int8 744, int4-a8 725 (96.5%), int4-vnni 725, torch's int4 723.
# So the 1.5B takes one digit, and no int4 arithmetic reaches the floor on the 0.5B: `auto` runs it on int8.
# int8 again after our int8 kernels moved to groups of sixteen rows (int8-vnni, and int8-avx2 on its floats: each
# block's dot product exact in int32, scaled once, where int8-avx2 had summed four partial lanes), 2026-12-06
# 23:24-23:42 UTC, same machine, by `... --models small,large --dtype int8 --batch 1 --no-hf --no-llama-cpp
# --agreement` (int8-vnni on every projection): 0.5B 744/751 (unchanged), 1.5B 897/905 (one position fewer).
MEASURED: dict[str, dict[str, float]] = {
    "embedded:qwen2.5-coder-0.5b-instruct": {"bfloat16": 0.995, "int8": 0.991, "int4": 0.963, "int4-vnni": 0.965,
                                             "int4-a8": 0.965},
    "embedded:qwen2.5-coder-1.5b-instruct": {"bfloat16": 0.993, "int8": 0.991, "int4": 0.985, "int4-vnni": 0.986,
                                             "int4-a8": 0.977},
}


class AutoChoice(NamedTuple):
    dtype: str | None  # the quantized dtype, or None: no record reaches the floor
    kernels: tuple[str, ...] = ()  # int4: the kernels whose arithmetic the record measured (empty: any)
    record: str = ""  # the record it rests on: "int4-a8", "int4-vnni", "int4" or "int8"


def auto_choice(source: str, kernel: str = "auto", ours: bool | None = None) -> AutoChoice:
    """The smallest quantized dtype that agreed well enough with fp32 for `source` on the arithmetic it would
    run. `kernel`: the model's `kernel` (one of ours counts its own record alone, any other torch's int4
    record); `ours`: whether our int4 kernels build here (default: whether this machine can build one;
    nothing is built here)."""
    measured = MEASURED.get(source, {})
    if kernel != "auto":
        int4 = [(record_of(kernel), ())]
    elif our_int4_built() if ours is None else ours:
        int4 = list(OUR_INT4.items())
    else:
        int4 = [("int4", TORCH_INT4)]
    for record, kernels in int4:
        if measured.get(record, 0.0) >= AGREEMENT_FLOOR:
            return AutoChoice("int4", kernels, record)
    if measured.get("int8", 0.0) >= AGREEMENT_FLOOR:
        return AutoChoice("int8", (), "int8")
    return AutoChoice(None)


def record_of(kernel: str) -> str:
    """The int4 record whose arithmetic a kernel named in a config runs: one of ours (or a record's name, as
    `kernel: int4-a8` names our one-digit kernels) its own, any other torch's."""
    return kernel if kernel in OUR_INT4 else next((r for r, kernels in OUR_INT4.items() if kernel in kernels), "int4")


def our_int4_built() -> bool:
    """Whether this machine can build our int4 kernels (OUR_INT4; nothing is built here)."""
    from tokenrouter.models import native
    return not native.vnni_missing() or not native.avx2_missing()  # NOTE: avxvnni needs what avx2 needs and more

