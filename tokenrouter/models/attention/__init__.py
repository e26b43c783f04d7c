"""Attention over a paged KV cache: one module per backend behind one interface (base.AttentionBackend).

The cache of one layer is `[num_blocks, block_size, num_kv_heads, head_dim]`; a token's slot is
`block_table[pos // block_size] * block_size + pos % block_size`. Every backend reads this layout and the
common metadata of metadata.py, built once per step by tokenrouter/engine/step_inputs.py.

- cpu: paged attention in C++ reading the cache in place (the CPU's, where tokenrouter.models.native builds it)
- torch: gathers each context into dense tensors (any device; the CPU's where the C++ one cannot be built)
- triton: one paged kernel that reads the cache in place (CUDA's default; capture-safe)
- flash: flash-attn's paged kernels, when installed and asked for
"""
from __future__ import annotations

import torch

from tokenrouter.models.attention.base import AttentionBackend
from tokenrouter.models.attention.cpu_backend import CpuBackend
from tokenrouter.models.attention.flash_backend import FlashBackend
from tokenrouter.models.attention.metadata import AttentionMetadata, store_kv
from tokenrouter.models.attention.torch_backend import TorchBackend
from tokenrouter.models.attention.triton_backend import TritonBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"cpu": CpuBackend, "torch": TorchBackend, "triton": TritonBackend,
                                               "flash": FlashBackend}

__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "CpuBackend", "TorchBackend", "choose_backend",
           "flash_available", "store_kv"]


def choose_backend(requested: str, device: str, block_size: int, dtype: str = "bfloat16") -> AttentionBackend:
    """`auto`: Triton on CUDA where it is installed, the C++ kernel on a CPU where it builds, else torch; a backend
    asked for by name must be able to run here (ValueError naming attention_backend and why not)."""
    if requested == "auto":
        kind = torch.device(device).type
        preferred = TritonBackend() if kind == "cuda" else CpuBackend() if kind == "cpu" else None
        if preferred is not None and not preferred.check(device, block_size, dtype):
            return preferred
        return TorchBackend()
    if requested not in BACKENDS:
        raise ValueError(f"attention_backend: must be one of {['auto', *BACKENDS]}, got {requested!r}")
    backend = BACKENDS[requested]()
    why = backend.check(device, block_size, dtype)
    if why:
        raise ValueError(f"attention_backend={requested!r}: {why}")
    return backend


def flash_available(device: torch.device | str) -> bool:
    return not FlashBackend().check(str(device), 256, "bfloat16")
