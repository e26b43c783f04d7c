"""Tensor parallelism: one model as N ranks joined by torch.distributed (NCCL on CUDA, gloo on CPU).

Megatron-style split: q/k/v and gate/up are column-parallel (each rank holds its heads, its KV heads and
its slice of the MLP), o_proj and down_proj are row-parallel (each rank multiplies its slice, one
all-reduce sums the parts). Embedding, norms and lm_head are replicated, so every rank ends a step with
the full hidden state and logits; rank 0 answers the driver.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class TensorParallel:
    rank: int
    size: int
    device: str = "cpu"  # where the group's collectives run (NCCL takes only CUDA tensors)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def any(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank: a collective, so every rank gets the same answer at the same step."""
        if self.size == 1:
            return flag
        x = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return bool(x.item())

    def split(self, total: int, what: str) -> tuple[int, int]:
        """This rank's (offset, length) of `total` units split evenly."""
        if total % self.size:
            raise ValueError(f"tensor_parallel_size={self.size} must divide {what} ({total})")
        n = total // self.size
        return self.rank * n, n

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def init_tensor_parallel(rank: int, size: int, init_method: str, device: str) -> TensorParallel:
    """Join the model's process group; `init_method` is rank 0's rendezvous (tcp://host:port)."""
    if size > 1:
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    return TensorParallel(rank, size, device)
