"""The model runner: the only code that touches tensors. It turns a batch of chunks into one forward pass."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenrouter.config import ModelSpec
from tokenrouter.models.attention import AttentionMetadata, choose_backend
from tokenrouter.models.calibration import auto_quantized
from tokenrouter.models.decoder import SINGLE, DecoderConfig, DecoderLM, load_weights
from tokenrouter.models.kernels import KernelChoice, bf16_fast
from tokenrouter.models.parallel import TensorParallel
from tokenrouter.models.prepare import QUANTIZED, prepare_linears, quant_cache_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.float32, "int4": torch.float32}  # the activations' dtype (weight-only quantization)


@dataclass(slots=True)
class Chunk:
    """Tokens of one sequence to compute in this step: positions `start .. start + len(token_ids) - 1`.
    `start` is the number of this sequence's tokens already in this model's KV cache."""
    token_ids: list[int]
    start: int
    block_table: list[int]
    num_outputs: int = 1  # logits and hidden states for the last `num_outputs` positions of the chunk


@dataclass(slots=True)
class StepOutput:
    logits: torch.Tensor  # [M, vocab] float32, M = sum of num_outputs, chunk by chunk
    hidden: torch.Tensor  # [M, hidden] the final-norm hidden state that produced each row of logits
    offsets: list[int] = field(default_factory=list)  # row where each chunk's outputs start


class ModelRunner:
    def __init__(self, spec: ModelSpec, model_dir: Path | str, tp: TensorParallel | None = None):
        """`tp`: this runner is one rank of a tensor-parallel model (its heads, KV heads and MLP slice)."""
        self.spec = spec
        self.tp = tp
        self.tp_size = tp.size if tp is not None else 1
        self.model_dir = Path(model_dir)
        self.cfg = DecoderConfig.from_dir(self.model_dir)
        self.device = torch.device(spec.device)
        self.weight_dtype = resolve_dtype(spec)  # what `dtype: auto` became on this machine
        self.dtype = DTYPES[self.weight_dtype]
        self.block_size = spec.block_size
        self.max_model_len = spec.max_model_len or self.cfg.max_position_embeddings
        self.backend = choose_backend(spec.attention_backend, spec.device, spec.block_size, self.weight_dtype)
        with _default_dtype(self.dtype), self.device:
            self.model = DecoderLM(self.cfg, self.max_model_len, tp or SINGLE)
        load_weights(self.model, self.model_dir)
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        self.kernels = None  # tokenrouter.models.kernels.KernelChoice: which kernel each projection shape got
        if self.device.type == "cpu":
            rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
            cache = (quant_cache_file(self.model_dir, self.weight_dtype, spec.group_size, rank, size)
                     if self.weight_dtype in QUANTIZED else None)
            self.kernels = prepare_linears(self.model, self.weight_dtype, self.dtype, spec.group_size,
                                           KernelChoice(forced="" if spec.kernel == "auto" else spec.kernel), cache)
        self.packed = self.kernels is not None
        self.weight_bytes = self.model.weight_bytes()
        self.model.set_attention_backend(self.backend)
        self.model.eval()
        self.num_blocks = spec.num_kv_blocks or self._blocks_for(self._kv_budget_gib())
        cfg = self.cfg
        self.kv_cache = torch.zeros(cfg.num_layers, 2, self.num_blocks, self.block_size,
                                    cfg.num_kv_heads // self.tp_size, cfg.head_dim, dtype=self.dtype, device=self.device)

    def _kv_budget_gib(self) -> float:
        if self.spec.kv_cache_memory_gib:
            return self.spec.kv_cache_memory_gib
        if self.device.type != "cuda":
            return 1.0
        # NOTE: as vLLM does: the weights are loaded by now, so all memory in use on the device counts
        # against the utilisation budget and the KV pool takes what is left of it.
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.spec.gpu_memory_utilization - (total - free)
        if budget <= 0:
            raise ValueError(f"{self.spec.name}: gpu_memory_utilization={self.spec.gpu_memory_utilization} of "
                             f"{total / 2**30:.1f} GiB on {self.device} leaves no room for the KV cache "
                             f"({(total - free) / 2**30:.1f} GiB in use after loading the weights)")
        return budget / 2**30

    def _blocks_for(self, gib: float) -> int:
        cfg = self.cfg
        per_block = (2 * cfg.num_layers * self.block_size * cfg.num_kv_heads // self.tp_size * cfg.head_dim
                     * self.dtype.itemsize)
        return max(1, int(gib * 2**30) // per_block)

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> StepOutput:
        input_ids, positions, meta, output_rows, offsets = self._prepare(chunks)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        if output_rows is not None:
            hidden = hidden[output_rows]
        return StepOutput(self.model.compute_logits(hidden), hidden, offsets)

    def _prepare(self, chunks: list[Chunk]):
        bs = self.block_size
        ids, pos, slots, output_rows, offsets = [], [], [], [], []
        query_lens, context_lens, context_blocks, context_starts = [], [], [], []
        decode_rows, decode_tables, decode_lens = [], [], []
        row = 0
        for c in chunks:
            n, end = len(c.token_ids), c.start + len(c.token_ids)
            if n == 0:
                raise ValueError("a chunk needs at least one token")
            if end > self.max_model_len:
                raise ValueError(f"sequence length {end} exceeds max_model_len={self.max_model_len}")
            if len(c.block_table) * bs < end:
                raise ValueError(f"block table holds {len(c.block_table) * bs} slots, chunk needs {end}")
            if not 1 <= c.num_outputs <= n:
                raise ValueError(f"num_outputs must be in [1, {n}], got {c.num_outputs}")
            ids.extend(c.token_ids)
            pos.extend(range(c.start, end))
            slots.extend(c.block_table[p // bs] * bs + p % bs for p in range(c.start, end))
            query_lens.append(n)
            context_lens.append(end)
            table = c.block_table[:(end + bs - 1) // bs]
            if n == 1:  # decode rows attend together (torch backend); only multi-token chunks gather blocks
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(end)
                context_starts.append(-1)
            else:
                context_starts.append(len(context_blocks) * bs)
                context_blocks.extend(table)
            offsets.append(len(output_rows))
            output_rows.extend(range(row + n - c.num_outputs, row + n))
            row += n
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_lens=query_lens,
            context_lens=context_lens,
        )
        if self.backend == "flash":
            width = max(len(c.block_table) for c in chunks)
            meta.block_tables = torch.tensor([c.block_table + [0] * (width - len(c.block_table)) for c in chunks],
                                             dtype=torch.int32, device=device)
            meta.cu_seqlens_q = _cumsum(query_lens, device)
            meta.cu_seqlens_k = _cumsum(context_lens, device)
        else:
            meta.context_blocks = torch.tensor(context_blocks, dtype=torch.long, device=device)
            meta.context_starts = context_starts
            if decode_rows:
                meta.decode_rows = None if len(decode_rows) == row else torch.tensor(decode_rows, device=device)
                meta.decode_slots, meta.decode_mask = _decode_slots(decode_tables, decode_lens, bs, device)
        # output rows ascend, so as many as the tokens means every row (a decode step): no gather needed
        rows = None if len(output_rows) == row else torch.tensor(output_rows, dtype=torch.long, device=device)
        return (torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(pos, dtype=torch.long, device=device),
                meta, rows, offsets)


def resolve_dtype(spec: ModelSpec) -> str:
    """`dtype: auto`: on CUDA bf16; on a CPU the quantized dtype whose greedy agreement with fp32 was measured
    at >= 97% for this model (tokenrouter/models/calibration.py), else bf16 where the CPU has AVX512-BF16 or
    AMX, else fp32."""
    if spec.dtype != "auto":
        return spec.dtype
    if torch.device(spec.device).type == "cuda":
        return "bfloat16"
    # a forced int4 kernel other than ours runs torch's int4 arithmetic
    quantized = auto_quantized(spec.source, vnni=None if spec.kernel in ("auto", "int4-vnni") else False)
    if quantized:
        return quantized
    return "bfloat16" if bf16_fast() else "float32"


def _decode_slots(tables: list[list[int]], lens: list[int], bs: int, device: torch.device):
    """Cache slots of every decode row's context, padded to the longest: slots [B, L], mask [B, L] (None when
    every row's context is L long, batch 1 among them: nothing to mask)."""
    width = max(len(t) for t in tables)
    blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
    slots = (blocks[:, :, None] * bs + torch.arange(bs, device=device)).flatten(1)[:, :max(lens)]
    if min(lens) == max(lens):
        return slots, None
    mask = torch.arange(slots.shape[1], device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    return slots, mask


def _cumsum(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0] + values, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def default_torch_threads(num_models: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, num_models))
