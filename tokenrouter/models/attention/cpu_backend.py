"""The CPU's backend where the `cpu-ops` kernels build (tokenrouter/models/csrc/cpu_ops.cpp): one C++ call a layer
attends every token of the step (decode rows, catch-ups, verifying chunks, prefills) reading the paged cache in
place, the query heads of a kv head sharing each key as it is read. Each token runs the same code whatever chunk
it is in, so its floats do not depend on how the sequence was split into steps: a token a verifying or catch-up
chunk computes equals the same token decoded alone, and a prompt prefilled in one chunk or several gives the same
cache, bit for bit.

NOTE: until 2026-12-07 chunks longer than 16 tokens (prefills) attended with matmuls over their gathered context,
as the torch backend's do. A prefill that held a sequence's first drafts (`verify:every=4`'s first visit to the
large model) then computed them otherwise than all-large's decode steps did, and on one-digit int4, which rounds
each activation to 8 bits, that moved logits by up to 0.16: 7 of 8 outputs of 128 tokens equalled all-large's.
With every token here, 8 of 8; and on an AMD EPYC Zen 5 a 1.5B prefill (int4, two threads) took the same or less:
48 tokens 142-190 against 151-196 ms, 256 785-842 against 837-841, 1,024 5.3-5.7 against 6.4-6.5 s, 2,048
15.5-16.7 against 20.1-20.7 s (docs/kernels.md, "Between the projections").

With the other CPU ops (DecoderLM.use_cpu_ops) it took a decode step of the 0.5B (int4, 2 cores) from 21.3 to
17.4-18.1 ms and of the 1.5B from 50 to 43-45 (docs/kernels.md, "Between the projections").
"""
from __future__ import annotations

import torch

from tokenrouter.models.attention.metadata import AttentionMetadata
from tokenrouter.models.attention.torch_backend import TorchBackend


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self):
        self.ops = None

    def captures(self, query_len: int) -> bool:
        return False  # no graphs on a CPU

    def check(self, device: str, block_size: int, dtype: str) -> str:
        if torch.device(device).type != "cpu":
            return "runs on a CPU only"
        from tokenrouter.models import native
        why = native.cpu_ops_missing()
        if why:
            return f"the cpu-ops kernels cannot be built here: {why}"
        self.ops = native.cpu_ops()
        return "" if self.ops is not None else "the cpu-ops kernels failed to build (see the log)"

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        meta.extra = {}

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        # q: [N, Hq, D] (rows may be strided, as a view of the layer's qkv) -> [N, Hq, D]
        dtype = q.dtype
        q = q if dtype == torch.float32 else q.float()
        out = torch.empty(q.shape, dtype=torch.float32)
        self.ops.paged_attention_(out, q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                  scale, meta.max_query_len)
        return out if dtype == torch.float32 else out.to(dtype)
