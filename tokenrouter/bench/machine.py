"""The machine a benchmark ran on: CPU model, the instruction-set flags that pick its kernels (AVX-512,
BF16, AMX), core count, torch and its threads, and the GPU where there is one. Every bench command writes
it into its JSON and prints it above its table, so a measured number always says where it came from."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def machine() -> dict:
    cpu, flags = cpu_info()
    info = {"cpu": cpu, "flags": [f for f in FLAGS if f in flags], "cores": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def describe(info: dict) -> str:
    """One line: "machine: AMD EPYC, 2 cores (avx2 avx512f avx512_bf16), torch 2.13.0 on 2 threads"."""
    flags = " ".join(info["flags"]) or "no AVX2"
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ""
    return (f"machine: {info['cpu']}, {info['cores']} cores ({flags}){gpu}, torch {info['torch']} on "
            f"{info['threads']} threads")


def announce(info: dict | None = None) -> dict:
    """Print the machine line (above a benchmark's table) and return the record for its JSON."""
    info = info or machine()
    print(describe(info), flush=True)
    return info


def cpu_info(path: str | Path = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """The CPU's model name and flags from /proc/cpuinfo (Linux); elsewhere what `platform` knows."""
    try:
        text = Path(path).read_text()
    except OSError:
        return platform.processor() or platform.machine() or "unknown CPU", set()
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    name = fields.get("model name") or fields.get("Model") or fields.get("Hardware") or platform.machine()
    return name or "unknown CPU", set(fields.get("flags", fields.get("Features", "")).split())
