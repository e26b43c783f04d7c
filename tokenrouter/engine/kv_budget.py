"""The KV pool's budget on CUDA, sized as vLLM sizes it: after the weights are loaded, a profile step runs the
largest step the scheduler can send on a throwaway pool and measures what it adds at its peak; the pool takes
what `gpu_memory_utilization` of the device leaves after everything else:

    KV = total * gpu_memory_utilization - (in use after loading + activations' peak + CUDA graphs' estimate)

"In use" is everything on the device, read from the driver: this model's weights, the CUDA context, and what
other models (in this process or another) hold there already, so a model sizes its pool from what is left.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 2**30


@dataclass(slots=True)
class StepLimits:
    """The largest step the scheduler sends a model: at most `max_num_batched_tokens` tokens in at most
    `max_num_seqs` chunks, none past `max_model_len`."""
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def largest_step(self) -> list[tuple[int, int]]:
        """(tokens, start) per chunk of the step that needs the most memory: every token it can take, one long
        chunk and as many others as allowed, each ending at `max_model_len` (the longest contexts to attend to)."""
        seqs, length = self.max_num_seqs, self.max_model_len
        tokens = min(self.max_num_batched_tokens, seqs * length)
        seqs = min(seqs, tokens)
        first = min(tokens - (seqs - 1), length)
        rest, others = tokens - first, seqs - 1
        sizes = [first, *(rest // others + (i < rest % others) for i in range(others))]
        return [(n, length - n) for n in sizes]

    def largest_decode(self) -> list[tuple[int, int]]:
        """(tokens, start) per row of the largest all-decode step, every row at `max_model_len`."""
        rows = min(self.max_num_seqs, self.max_num_batched_tokens)
        return [(1, self.max_model_len - 1)] * rows


@dataclass(slots=True)
class MemoryProfile:
    """Bytes on one CUDA device, as the profile step measured them before the KV pool was allocated."""
    total: int
    in_use: int  # after loading the weights: everything on the device (driver's figure)
    weights: int  # of in_use, this model's weights
    activations: int  # the largest step's peak beyond in_use: torch's caching allocator and memory outside torch
    graphs: int = 0  # CUDA graphs' memory pool and static buffers, estimated before capture (0: no graphs)

    def kv_bytes(self, utilization: float) -> int:
        """What `utilization` of the device leaves for the KV pool (<= 0: no room)."""
        return int(self.total * utilization) - self.in_use - self.activations - self.graphs

    def no_room(self, name: str, device, utilization: float, limits: StepLimits) -> ValueError:
        return ValueError(
            f"{name}: gpu_memory_utilization={utilization} of {gib(self.total)} GiB on {device} leaves no room for "
            f"the KV cache: {gib(self.in_use)} GiB in use after loading the weights ({gib(self.weights)} GiB of them "
            f"this model's), {gib(self.activations)} GiB for the activations of the largest step "
            f"({limits.max_num_batched_tokens} tokens in up to {limits.max_num_seqs} sequences), "
            f"{gib(self.graphs)} GiB for CUDA graphs; raise gpu_memory_utilization, lower the scheduler's "
            f"max_num_batched_tokens or max_num_seqs, or set cuda_graphs: false")


def gib(n: int | float) -> str:
    return f"{n / GIB:.2f}"


def in_use(device: torch.device) -> int:
    """Bytes in use on a CUDA device, by anything (the driver's figure)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free


class PeakMemory:
    """Bytes a block of work adds to a CUDA device at its peak: what torch's caching allocator reserved beyond what
    it held before (its peak reservation, so block rounding and fragmentation count) plus memory outside torch that
    grew (kernels loaded, a communicator's buffers). Cached blocks are released before and after. 0 on a CPU."""

    def __init__(self, device: torch.device):
        self.device, self.bytes, self.allocated = device, 0, 0
        self.cuda = device.type == "cuda"

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            release(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._reserved = torch.cuda.memory_reserved(self.device)
            self._allocated = torch.cuda.memory_allocated(self.device)
            self._outside = in_use(self.device) - self._reserved
        return self

    def __exit__(self, *exc) -> None:
        if not self.cuda or exc[0] is not None:
            return
        torch.cuda.synchronize(self.device)
        outside = in_use(self.device) - torch.cuda.memory_reserved(self.device)
        self.allocated = torch.cuda.max_memory_allocated(self.device) - self._allocated
        reserved = torch.cuda.max_memory_reserved(self.device) - self._reserved
        self.bytes = max(reserved, self.allocated) + max(0, outside - self._outside)
        release(self.device)


def release(device: torch.device) -> None:
    """Wait for the device and hand torch's cached, unused blocks back to it."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
