"""CUDA graphs for decode steps: one graph per batch-size bucket over static input buffers.

A step whose rows are all single-token decode rows copies its inputs into the static buffers' first `bs` rows
(`bs` the next bucket up), replays the graph captured for `bs`, and reads the first B rows of its output hidden
states; logits, policy features and sampling run after the replay. Steps with multi-token chunks run eagerly.
Without capture (`capture=False`) the same static-buffer forward runs eagerly: the CPU stand-in the tests use
to check bucketing and padding against the plain path.
"""
from __future__ import annotations

import logging
import time

import torch

from tokenrouter.engine.kv_budget import in_use, release
from tokenrouter.engine.step_inputs import HostStep, Staging
from tokenrouter.models.attention import AttentionBackend, AttentionMetadata

log = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16  # past the small buckets, every multiple of 16


def buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then multiples of 16 up to max_batch rounded up to one."""
    top = max_batch if max_batch <= SMALL_BUCKETS[-1] else -(-max_batch // BUCKET_STEP) * BUCKET_STEP
    return sorted({b for b in SMALL_BUCKETS if b < top} | set(range(BUCKET_STEP, top + 1, BUCKET_STEP)) | {top})


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, backend: AttentionBackend, block_size: int, max_batch: int,
                 max_blocks: int, scratch_block: int, capture: bool = True):
        """`max_blocks`: block-table width of the longest sequence (max_model_len); `scratch_block`: a block of the
        KV pool that no sequence owns."""
        self.model, self.kv_cache, self.backend, self.block_size = model, kv_cache, backend, block_size
        self.buckets = buckets(max_batch)
        self.max_batch, self.max_blocks = self.buckets[-1], max_blocks
        top, device = self.max_batch, kv_cache.device
        # NOTE: padded rows (B .. bs-1 of a bucket) decode token 0 at position 0 of the scratch block: they write
        # its first slot and attend to it alone, so their outputs are finite; they are dropped after the replay.
        # Table entries past a row's context point at the scratch block too, so every entry is a valid block.
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        # static inputs, one int32 buffer: ids [top] | positions [top] | slots [top] | seq_lens [top] | tables
        self.static = torch.zeros(top * (4 + max_blocks), dtype=torch.int32, device=device)
        ids, pos, slots, lens, tables = self.static.split([top, top, top, top, top * max_blocks])
        self.ids, self.pos, self.slots, self.lens, self.tables = ids, pos, slots, lens, tables.view(top, max_blocks)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)  # every row one token
        self.staging = Staging(device, self.static.numel())
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> its graph's output hidden states [bs, hidden]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.memory = 0  # bytes the capture took on the device (its memory pool, graph objects, workspaces)
        if capture:
            self._capture_all()

    def fits(self, host: HostStep) -> bool:
        return (host.output_rows is None and len(host.query_lens) <= self.max_batch
                and host.block_tables.shape[1] <= self.max_blocks and bool((host.query_lens == 1).all()))

    def run(self, host: HostStep) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode step (`fits(host)`)."""
        b = len(host.query_lens)
        bs = next(x for x in self.buckets if x >= b)
        self._fill(host, bs)
        if bs in self.graphs:
            self.graphs[bs].replay()
            out = self.outputs[bs]
        else:
            out = self._forward(bs)
        # NOTE: the graph's output buffer is overwritten by the next replay; the step's readers get their own copy
        return out[:b].clone()

    def dry_run(self, bs: int = 0) -> torch.Tensor:
        """The forward a graph of bucket `bs` (0: the largest) captures, run eagerly on padding rows alone: the
        capture's warm-up, and the KV budget's estimate of the graphs' memory (tokenrouter/engine/kv_budget.py)."""
        bs = bs or self.max_batch
        self._fill(None, bs)
        return self._forward(bs)

    def _forward(self, bs: int) -> torch.Tensor:
        # what a graph captures: metadata over the static buffers' first bs rows, then the model
        meta = AttentionMetadata(slot_mapping=self.slots[:bs].long(), query_start_loc=self.query_start_loc[:bs + 1],
                                 seq_lens=self.lens[:bs], block_tables=self.tables[:bs], num_seqs=bs, max_query_len=1)
        self.backend.prepare(meta, self.block_size)
        return self.model(self.ids[:bs], self.pos[:bs], self.kv_cache, meta)

    def _fill(self, host: HostStep | None, bs: int) -> None:
        """Write rows 0 .. bs-1 of the static inputs (real rows, then padding) in one host-to-device copy."""
        top, b = self.max_batch, 0 if host is None else len(host.query_lens)
        staging = self.staging.host(self.static.numel())
        ids, pos, slots, lens = (staging[i * top:i * top + bs] for i in range(4))
        tables = staging[4 * top:].reshape(top, self.max_blocks)[:bs]
        tables.fill(self.scratch_block)
        ids[b:], pos[b:], slots[b:], lens[b:] = 0, 0, self.scratch_slot, 1
        if b:
            ids[:b], pos[:b], slots[:b], lens[:b] = host.input_ids, host.positions, host.slot_mapping, host.seq_lens
            tables[:b, :host.block_tables.shape[1]] = host.block_tables
        self.staging.copy_to(self.static)

    def _capture_all(self) -> None:
        t, device = time.perf_counter(), self.static.device
        release(device)
        before = in_use(device)
        pool, stream = None, torch.cuda.Stream(device)  # NOTE: torch's default capture stream is on one device
        # NOTE: largest first, so the smaller graphs reuse the largest one's memory in the shared pool
        for bs in reversed(self.buckets):
            self.dry_run(bs)  # warm-up outside capture: kernel compilation, autotuning, lazy allocations
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        release(device)  # the warm-ups' cached blocks are the eager steps' (the KV budget's activations)
        self.memory = in_use(device) - before
        log.info("captured %d decode CUDA graphs (batch %s) in %.1f s, %.0f MiB of graph memory",
                 len(self.graphs), ",".join(map(str, self.buckets)), time.perf_counter() - t, self.memory / 2**20)
