"""The model runner: the only code that touches tensors. It turns a batch of chunks into one forward pass."""
from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenrouter.config import ModelSpec
from tokenrouter.engine.cuda_graphs import DecodeGraphs
from tokenrouter.engine.step_inputs import StepInputs, build_host_step
from tokenrouter.models.attention import choose_backend
from tokenrouter.models.calibration import TWO_DIGIT_INT4, auto_quantized, two_digit_int4_built
from tokenrouter.models.decoder import SINGLE, DecoderConfig, DecoderLM, load_weights
from tokenrouter.models.kernels import KernelChoice, bf16_fast
from tokenrouter.models.parallel import TensorParallel
from tokenrouter.models.prepare import QUANTIZED, load_quantized, prepare_linears, quant_cache_file

log = logging.getLogger(__name__)
DEFAULT_GRAPH_BATCH = 64  # cuda_graph_max_batch for a spec used outside a config (a config gives max_num_seqs)
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
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        self.kernels = None  # tokenrouter.models.kernels.KernelChoice: which kernel each projection shape got
        quantized = None
        if self.weight_dtype in QUANTIZED:  # (CPU only: ModelSpec refuses them elsewhere)
            rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
            cache = quant_cache_file(self.model_dir, self.weight_dtype, spec.group_size, rank, size)
            quantized = load_quantized(self.model, self.model_dir, self.weight_dtype, spec.group_size, cache)
        else:
            load_weights(self.model, self.model_dir)
        if self.device.type == "cpu":
            self.kernels = prepare_linears(self.model, self.weight_dtype, self.dtype, spec.group_size,
                                           KernelChoice(forced="" if spec.kernel == "auto" else spec.kernel), quantized,
                                           only=auto_kernels(spec, self.weight_dtype))
        self.packed = self.kernels is not None
        self.weight_bytes = self.model.weight_bytes()
        self.model.set_attention_backend(self.backend)
        self.model.eval()
        self.num_blocks = spec.num_kv_blocks or self._blocks_for(self._kv_budget_gib())
        # NOTE: the pool holds one block more than the block managers hand out: the scratch block, which the
        # padded rows of a graph step write and read (tokenrouter/engine/cuda_graphs.py)
        self.scratch_block = self.num_blocks
        cfg = self.cfg
        self.kv_cache = zeros((cfg.num_layers, 2, self.num_blocks + 1, self.block_size, cfg.num_kv_heads // self.tp_size,
                               cfg.head_dim), self.dtype, self.device)
        self.inputs = StepInputs(self.device, self.backend, self.block_size)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and spec.cuda_graphs:
            why = graphs_unavailable(self.backend, self.tp_size)
            if why:
                log.info("%s: decode steps run eagerly: %s", spec.name, why)
            else:
                self.use_cuda_graphs(spec.cuda_graph_max_batch or DEFAULT_GRAPH_BATCH)

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

    def use_cuda_graphs(self, max_batch: int, capture: bool = True) -> None:
        """Decode steps of up to `max_batch` rows replay CUDA graphs (capture=False: the same static-buffer forward,
        run eagerly, on any device; tests)."""
        with torch.inference_mode():
            self.graphs = DecodeGraphs(self.model, self.kv_cache, self.backend, self.block_size, max_batch,
                                       -(-self.max_model_len // self.block_size), self.scratch_block, capture)

    def mark(self):
        """A point in this device's work, for `elapsed` (a CUDA event: no synchronisation; a CPU's clock)."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed(self, start, end) -> float:
        """Seconds of device work between two marks (waits for `end` on CUDA)."""
        if self.device.type != "cuda":
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    @torch.inference_mode()
    def run(self, chunks: list[Chunk]) -> StepOutput:
        host = build_host_step(chunks, self.block_size, self.max_model_len)
        if self.graphs is not None and self.graphs.fits(host):
            hidden = self.graphs.run(host)
        else:
            input_ids, positions, meta, output_rows = self.inputs.to_device(host)
            hidden = self.model(input_ids, positions, self.kv_cache, meta)
            if output_rows is not None:
                hidden = hidden[output_rows]
        return StepOutput(self.model.compute_logits(hidden), hidden, host.offsets)


def graphs_unavailable(backend, tp_size: int) -> str:
    """Why decode steps cannot be captured ("" when they can)."""
    if not backend.capturable:
        return f"attention_backend {backend.name!r} reads host metadata"
    if tp_size > 1:  # NOTE: torch.distributed's all-reduce inside a captured graph has not been checked here
        return "tensor_parallel_size > 1"
    return ""


def resolve_dtype(spec: ModelSpec) -> str:
    """`dtype: auto`: on CUDA bf16; on a CPU the quantized dtype whose greedy agreement with fp32 was measured
    at >= 97% for this model (tokenrouter/models/calibration.py), else bf16 where the CPU has AVX512-BF16 or
    AMX, else fp32."""
    if spec.dtype != "auto":
        return spec.dtype
    if torch.device(spec.device).type == "cuda":
        return "bfloat16"
    # a forced int4 kernel other than ours runs torch's int4 arithmetic
    quantized = auto_quantized(spec.source, vnni=None if spec.kernel in ("auto", "int4-vnni", "int4-avx2") else False)
    if quantized:
        return quantized
    return "bfloat16" if bf16_fast() else "float32"


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on a CPU in anonymous memory, whose pages the system hands out zeroed as they are first
    written, so a KV pool is resident only as far as sequences have filled it (torch.zeros writes every page:
    the default pair's 2.5 GiB of pools were resident from the start)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, max(nbytes, 1))
    # NOTE: the tensor keeps `buffer` alive (torch.frombuffer holds a reference to the object it wraps)
    return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).view(shape)


def auto_kernels(spec: ModelSpec, weight_dtype: str) -> tuple[str, ...]:
    """The kernels `dtype: auto` bound its choice to: int4 chosen on the two-digit kernels' agreement record runs
    on them (torch's int4 rounds activations to bf16 and agreed less)."""
    if spec.dtype == "auto" and weight_dtype == "int4" and spec.kernel == "auto" and two_digit_int4_built():
        return TWO_DIGIT_INT4
    return ()


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
