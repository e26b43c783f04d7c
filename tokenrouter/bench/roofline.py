"""This machine's roofline, measured with torch in the same run as the benchmark that quotes it."""
from __future__ import annotations

import time

import torch

from tokenrouter.models.layers import can_pack


def best_time(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_roofline(gemm_n: int = 2048, copy_mib: int = 512, repeat: int = 5) -> dict:
    """fp32 GEMM GFLOP/s (the faster of MKL and oneDNN); copy GB/s counted as bytes copied (each way), as in STREAM's bytes/2;
    read GB/s of a streaming reduction, the bound for reading weights once per decode step."""
    a, b = torch.randn(gemm_n, gemm_n), torch.randn(gemm_n, gemm_n)
    flops = 2 * gemm_n**3
    mkl = flops / best_time(lambda: a @ b, repeat) / 1e9
    onednn = 0.0
    if can_pack(torch.device("cpu"), torch.float32):
        packed = torch.ops.mkldnn._reorder_linear_weight(b, gemm_n)
        onednn = flops / best_time(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""),
                                   repeat) / 1e9
    src = torch.empty(copy_mib * 2**20 // 4).uniform_()
    dst = torch.empty_like(src)
    copy_s = best_time(lambda: dst.copy_(src), repeat)
    read_s = best_time(lambda: src.sum(), repeat)
    nbytes = src.numel() * 4
    return {
        "gemm_gflops": max(mkl, onednn),
        "gemm_mkl_gflops": mkl,
        "gemm_onednn_gflops": onednn,
        "copy_gbps": nbytes / copy_s / 1e9,
        "read_gbps": nbytes / read_s / 1e9,
        "threads": torch.get_num_threads(),
    }
