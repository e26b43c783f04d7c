"""The CPU's backend where the `cpu-ops` kernels build (tokenrouter/models/csrc/cpu_ops.cpp): one C++ call a layer
attends every decode row and every short chunk (a catch-up, a verifying chunk) reading the paged cache in place,
the query heads of a kv head sharing each key as it is read. Chunks longer than SHORT_CHUNK (prefill) attend as
the torch backend's do, with matmuls over their gathered context, where MKL's GEMMs beat a loop per token.

With the other CPU ops (DecoderLM.use_cpu_ops) it took a decode step of the 0.5B (int4, 2 cores) from 21.3 to
17.4-18.1 ms and of the 1.5B from 50 to 43-45 (docs/kernels.md, "Between the projections").
"""
from __future__ import annotations

import torch

from tokenrouter.models.attention.metadata import AttentionMetadata
from tokenrouter.models.attention.torch_backend import TorchBackend, attend_chunks, prepare_chunks

SHORT_CHUNK = 16  # chunks up to this many tokens attend in the C++ kernel; longer ones with matmuls


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
        if meta.max_query_len > SHORT_CHUNK:
            prepare_chunks(meta, block_size, SHORT_CHUNK)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        # q: [N, Hq, D] (rows may be strided, as a view of the layer's qkv) -> [N, Hq, D]
        dtype = q.dtype
        q = q if dtype == torch.float32 else q.float()
        out = torch.empty(q.shape, dtype=torch.float32)
        self.ops.paged_attention_(out, q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                  scale, SHORT_CHUNK)
        if meta.max_query_len > SHORT_CHUNK:
            attend_chunks(q * scale, k_cache, v_cache, meta, out, SHORT_CHUNK)
        return out if dtype == torch.float32 else out.to(dtype)
