"""The model runner: the only code that touches tensors. It turns a batch of chunks into one forward pass."""
from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from tokenrouter.config import KERNEL_FAMILIES, ModelSpec, SchedulerSpec
from tokenrouter.engine.cuda_graphs import StepGraphs
from tokenrouter.engine.kv_budget import GIB, MemoryProfile, PeakMemory, StepLimits, gib, in_use, release
from tokenrouter.engine.sampler import draw
from tokenrouter.engine.sequence import SamplingParams
from tokenrouter.engine.step_inputs import StepInputs, build_host_step
from tokenrouter.models.attention import choose_backend
from tokenrouter.models.calibration import OUR_INT4, auto_choice
from tokenrouter.models.decoder import SINGLE, DecoderConfig, DecoderLM, load_weights
from tokenrouter.models.kernels import KernelChoice, bf16_fast
from tokenrouter.models.parallel import TensorParallel
from tokenrouter.models.prepare import QUANTIZED, load_quantized, prepare_linears, quant_cache_file

log = logging.getLogger(__name__)
CPU_KV_GIB = 1.0  # a CPU's KV pool where the config gives no size
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9)  # the sampler's heaviest path: the whole vocabulary sorted
# NOTE: runners alive in this process, so that models sharing a device reserve room for the largest step once
_RUNNERS: weakref.WeakSet[ModelRunner] = weakref.WeakSet()
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
    def __init__(self, spec: ModelSpec, model_dir: Path | str, tp: TensorParallel | None = None,
                 kernels: tuple[str, ...] | None = None):
        """`tp`: this runner is one rank of a tensor-parallel model (its heads, KV heads and MLP slice).
        `kernels` (a CPU): the kernels a projection may take where one of them can run it (default: those whose
        arithmetic `dtype: auto` chose on, auto_kernels; () any)."""
        self.spec = spec
        self.tp = tp
        self.tp_size = tp.size if tp is not None else 1
        self.model_dir = Path(model_dir)
        self.cfg = DecoderConfig.from_dir(self.model_dir)
        self.device = torch.device(spec.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # NOTE: Triton launches its kernels on the thread's current device, not its tensors' (this thread loads
            # the model and runs its steps)
            torch.cuda.set_device(self.device)
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
                                           KernelChoice(forced="" if spec.kernel in ("auto", *KERNEL_FAMILIES)
                                                        else spec.kernel), quantized,
                                           only=auto_kernels(spec, self.weight_dtype) if kernels is None else kernels)
        self.packed = self.kernels is not None
        self.weight_bytes = self.model.weight_bytes()
        self.model.set_attention_backend(self.backend)
        if self.device.type == "cpu":
            from tokenrouter.models import native
            self.model.use_cpu_ops(native.cpu_ops())
        self.model.eval()
        self.inputs = StepInputs(self.device, self.backend, self.block_size)
        self.limits = step_limits(spec, self.max_model_len)
        graph_batch = self._graph_batch()
        # NOTE: on CUDA the largest step runs once before the KV pool exists, so the pool leaves room for it
        self.memory = self._profile_memory(graph_batch) if self.device.type == "cuda" else None
        _RUNNERS.add(self)
        self.num_blocks = self._num_blocks()
        # NOTE: the pool holds one block more than the block managers hand out: the scratch block, which the
        # padded rows of a graph step write and read (tokenrouter/engine/cuda_graphs.py)
        self.scratch_block = self.num_blocks
        self.kv_cache = zeros(self._pool_shape(self.num_blocks + 1), self.dtype, self.device)
        self.graphs: StepGraphs | None = None
        if graph_batch:
            self.use_cuda_graphs(graph_batch)
        if self.memory is not None:
            self._log_memory()

    def _graph_batch(self) -> int:
        """The largest batch graphs are captured for (0: none, every step eager)."""
        if self.device.type != "cuda" or not self.spec.cuda_graphs:
            return 0
        why = graphs_unavailable(self.backend, self.tp_size, self.spec.cuda_graph_query_lens)
        if why:
            log.info("%s: every step runs eagerly: %s", self.spec.name, why)
            return 0
        return self.spec.cuda_graph_max_batch or self.limits.max_num_seqs

    def _pool_shape(self, blocks: int) -> tuple[int, ...]:
        cfg = self.cfg
        return cfg.num_layers, 2, blocks, self.block_size, cfg.num_kv_heads // self.tp_size, cfg.head_dim

    def _block_bytes(self) -> int:
        return math.prod(self._pool_shape(1)) * self.dtype.itemsize

    def _num_blocks(self) -> int:
        spec, per_block = self.spec, self._block_bytes()
        if spec.num_kv_blocks:
            return spec.num_kv_blocks
        if spec.kv_cache_memory_gib or self.memory is None:
            return max(1, int((spec.kv_cache_memory_gib or CPU_KV_GIB) * GIB) // per_block)
        # NOTE: the pool holds one block more than it hands out (the scratch block): that one comes out of the budget
        blocks = self._agree(max(0, self.memory.kv_bytes(spec.gpu_memory_utilization) // per_block - 1))
        if blocks < 1:
            raise self.memory.no_room(spec.name, self.device, spec.gpu_memory_utilization, self.limits)
        return blocks

    def _agree(self, blocks: int) -> int:
        """The fewest blocks any rank of a tensor-parallel model has room for: the driver hands out rank 0's count,
        and every rank's pool must hold each block it hands out."""
        if self.tp_size == 1:
            return blocks
        x = torch.tensor([blocks], device=self.device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return int(x.item())

    @torch.inference_mode()
    def profile(self, graph_batch: int = 0) -> tuple[PeakMemory, PeakMemory]:
        """Run the largest steps the scheduler can send (`self.limits`: the most tokens, one long chunk and as many
        others as allowed, every context at max_model_len, logits for every token; then the largest all-decode step),
        each with a sampled draw per sequence, on a throwaway one-block KV pool, and, for `graph_batch` > 0, the
        forward the graph with the most tokens captures (StepGraphs.dry_run). On CUDA each PeakMemory holds what its
        part added at its peak (0 on a CPU). The runner's own KV cache is neither read nor written."""
        scratch = zeros(self._pool_shape(1), self.dtype, self.device)
        table = [0] * -(-self.max_model_len // self.block_size)  # every block of every context is the one block
        with PeakMemory(self.device) as steps:
            for shape in (self.limits.largest_step(), self.limits.largest_decode()):
                chunks = [Chunk([0] * n, start, table, n) for n, start in shape]
                logits = self.model.compute_logits(self._forward(
                    build_host_step(chunks, self.block_size, self.max_model_len), scratch))
                # the worker's sampler beside the step's logits: a row per sequence, all on its heaviest path
                rows = range(min(len(logits), self.limits.max_num_seqs))
                draw(logits.nan_to_num_(), rows, [SAMPLED] * len(rows), list(rows), [0] * len(rows))
                del logits
        with PeakMemory(self.device) as graphs:
            if graph_batch:
                self._graphs(graph_batch, scratch, len(table), 0, capture=False).dry_run()
        return steps, graphs

    def _profile_memory(self, graph_batch: int) -> MemoryProfile:
        release(self.device)
        total, before = torch.cuda.mem_get_info(self.device)[1], in_use(self.device)
        try:
            steps, graphs = self.profile(graph_batch)
        except torch.cuda.OutOfMemoryError as e:
            limits = self.limits
            raise ValueError(f"{self.spec.name}: the largest step ({limits.max_num_batched_tokens} tokens in up to "
                             f"{limits.max_num_seqs} sequences, contexts up to max_model_len={self.max_model_len}) "
                             f"does not fit on {self.device} beside the weights: lower the scheduler's "
                             f"max_num_batched_tokens or max_num_seqs, or max_model_len") from e
        # NOTE: models in one process on one device step one at a time on one thread and share torch's caching
        # allocator, so the largest step of any of them needs room once; the memory measured free here includes
        # the room a model sized before this one left for its own
        peers = [r.memory.activations for r in _RUNNERS if r.device == self.device and r.memory is not None]
        return MemoryProfile(total, before, self.weight_bytes, max([steps.bytes, *peers]), graphs.bytes)

    def _log_memory(self) -> None:
        """The start-up figures, once; a warning where what is in use now leaves the largest step too little room
        within gpu_memory_utilization (a pool size given in the config, or graphs that took more than estimated)."""
        memory, spec, now = self.memory, self.spec, in_use(self.device)
        kv = self.kv_cache.numel() * self.kv_cache.element_size()
        graphs = self.graphs.memory if self.graphs is not None else 0
        log.info("%s: KV cache: %d blocks, %s GiB; activations peak %s GiB; graphs %s GiB (%s estimated); weights %s "
                 "GiB; %s of %s GiB in use on %s", spec.name, self.num_blocks, gib(kv), gib(memory.activations),
                 gib(graphs), gib(memory.graphs), gib(self.weight_bytes), gib(now), gib(memory.total), self.device)
        over = now + memory.activations - int(memory.total * spec.gpu_memory_utilization)
        if over > 0:
            why = "the KV pool's size given in the config" if spec.kv_cache_memory_gib or spec.num_kv_blocks else \
                f"CUDA graphs took {gib(graphs)} GiB, {gib(memory.graphs)} GiB estimated"
            log.warning("%s: the largest step's activations (%s GiB) exceed gpu_memory_utilization=%s of %s by %s "
                        "GiB (%s): it may run out of memory", spec.name, gib(memory.activations),
                        spec.gpu_memory_utilization, self.device, gib(over), why)

    def use_cuda_graphs(self, max_batch: int, capture: bool = True, query_lens: tuple[int, ...] = ()) -> None:
        """Steps of up to `max_batch` rows, every row `q` new tokens for a q in `query_lens` (default: the spec's
        cuda_graph_query_lens), replay CUDA graphs (capture=False: the same static-buffer forward, run eagerly, on
        any device; tests)."""
        with torch.inference_mode():
            self.graphs = self._graphs(max_batch, self.kv_cache, -(-self.max_model_len // self.block_size),
                                       self.scratch_block, capture, query_lens)

    def _graphs(self, max_batch: int, kv_cache: torch.Tensor, max_blocks: int, scratch_block: int, capture: bool,
                query_lens: tuple[int, ...] = ()) -> StepGraphs:
        return StepGraphs(self.model, kv_cache, self.backend, self.block_size, max_batch, max_blocks, scratch_block,
                          tuple(query_lens or self.spec.cuda_graph_query_lens), self.limits.max_num_batched_tokens,
                          capture)

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
            hidden = self._forward(host, self.kv_cache)
        return StepOutput(self.model.compute_logits(hidden), hidden, host.offsets)

    def _forward(self, host, kv_cache: torch.Tensor) -> torch.Tensor:
        """Hidden states [M, hidden] of the step's output rows, run eagerly over `kv_cache`."""
        input_ids, positions, meta, output_rows = self.inputs.to_device(host)
        hidden = self.model(input_ids, positions, kv_cache, meta)
        return hidden if output_rows is None else hidden[output_rows]


def step_limits(spec: ModelSpec, max_model_len: int) -> StepLimits:
    """The largest step the model is sent: the scheduler's limits as the config set them on the spec, or the
    scheduler's defaults for a spec used outside a config."""
    default = SchedulerSpec()
    return StepLimits(spec.max_num_seqs or default.max_num_seqs,
                      spec.max_num_batched_tokens or default.max_num_batched_tokens, max_model_len)


def graphs_unavailable(backend, tp_size: int, query_lens: list[int]) -> str:
    """Why no step can be captured ("" when some can)."""
    if not any(backend.captures(q) for q in query_lens):
        return f"attention_backend {backend.name!r} reads host metadata for steps of {query_lens} tokens a row"
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
    quantized = auto_choice(spec.source, spec.kernel).dtype
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
    """The kernels `dtype: auto` bound its choice to: int4 chosen on one arithmetic's agreement record runs on the
    kernels of that arithmetic (one or two int8 digits per activation, or torch's bf16), never another's. A
    `kernel` naming an arithmetic (int4-a8) binds int4 to its kernels likewise, whatever the dtype's record."""
    if weight_dtype == "int4" and spec.kernel in KERNEL_FAMILIES:
        return OUR_INT4[spec.kernel]
    if spec.dtype == "auto" and weight_dtype == "int4" and spec.kernel == "auto":
        return auto_choice(spec.source).kernels
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
