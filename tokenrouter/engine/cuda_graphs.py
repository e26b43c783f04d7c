"""CUDA graphs for uniform steps: one graph per (tokens per row, batch-size bucket) over static input buffers.

A step whose rows all carry the same number q of new tokens, q one of the captured query lengths (1: decode
steps; k + 1: the verifying steps of `verify:every=k`), copies its inputs into the static buffers' first `bs`
rows (`bs` the next bucket up), replays the graph captured for (q, bs), and reads the first B * q rows of its
output hidden states (the step's output rows of them, where it asks for fewer); logits, policy features and
sampling run after the replay. Every other step (prefill, catch-up chunks of mixed lengths) runs eagerly.
Without capture (`capture=False`) the same static-buffer forward runs eagerly: the CPU stand-in the tests use
to check bucketing and padding against the plain path.
"""
from __future__ import annotations

import logging
import time

import numpy as np
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


class StepGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, backend: AttentionBackend, block_size: int, max_batch: int,
                 max_blocks: int, scratch_block: int, query_lens: tuple[int, ...] = (1,), max_tokens: int = 0,
                 capture: bool = True):
        """`max_blocks`: block-table width of the longest sequence (max_model_len); `scratch_block`: a block of the
        KV pool that no sequence owns; `query_lens`: tokens per row of the steps that get graphs, those the backend
        can capture (AttentionBackend.captures); `max_tokens`: the most tokens a step holds (the scheduler's
        max_num_batched_tokens; 0: no limit), which caps the batch of the longer rows."""
        self.model, self.kv_cache, self.backend, self.block_size = model, kv_cache, backend, block_size
        self.buckets: dict[int, list[int]] = {}  # tokens per row -> its batch buckets
        for q in sorted(set(query_lens)):
            rows = min(max_batch, max_tokens // q) if max_tokens else max_batch
            if not backend.captures(q):
                log.info("steps of %d tokens a row run eagerly: attention_backend %r reads host metadata for them",
                         q, backend.name)
            elif rows >= 1:
                self.buckets[q] = buckets(rows)
        if not self.buckets:
            raise ValueError(f"no step shape to capture: query lengths {sorted(set(query_lens))}, batch {max_batch}, "
                             f"{max_tokens} tokens, attention_backend {backend.name!r}")
        self.max_blocks = max_blocks
        # the largest shape first: capture order, and the dry run's (what the KV budget leaves room for)
        self.shapes = sorted(((q, bs) for q, bss in self.buckets.items() for bs in bss),
                             key=lambda s: (s[0] * s[1], s[1]), reverse=True)
        rows = max(bss[-1] for bss in self.buckets.values())
        tokens = self.shapes[0][0] * self.shapes[0][1]
        self.max_rows, self.max_tokens = rows, tokens
        device = kv_cache.device
        # NOTE: padded rows (B .. bs-1 of a bucket) compute q tokens at positions 0 .. q-1 of the scratch block: they
        # write its slots and attend to them alone, so their outputs are finite; they are dropped after the replay.
        # Table entries past a row's context point at the scratch block too, so every entry is a valid block.
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        # static inputs, one int32 buffer:
        #   ids [T] | positions [T] | slots [T] | output rows [T] | seq_lens [R] | tables [R, W]
        # (T the most tokens, R the most rows of any shape); a step copies the prefix up to its bucket's tables
        self.static = torch.zeros(4 * tokens + rows * (1 + max_blocks), dtype=torch.int32, device=device)
        ids, pos, slots, out_rows, lens, tables = self.static.split([tokens] * 4 + [rows, rows * max_blocks])
        self.ids, self.pos, self.slots, self.out_rows, self.lens = ids, pos, slots, out_rows, lens
        self.tables = tables.view(rows, max_blocks)
        self.starts = {q: torch.arange(0, q * (bss[-1] + 1), q, dtype=torch.int32, device=device)
                       for q, bss in self.buckets.items()}  # query_start_loc: every row q tokens
        self.staging = Staging(device, self.static.numel())
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # (q, bs) -> its graph's output hidden states
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.memory = 0  # bytes the capture took on the device (its memory pool, graph objects, workspaces)
        if capture:
            self._capture_all()

    def fits(self, host: HostStep) -> bool:
        q = int(host.query_lens[0])
        return (q in self.buckets and len(host.query_lens) <= self.buckets[q][-1]
                and host.block_tables.shape[1] <= self.max_blocks and bool((host.query_lens == q).all()))

    def run(self, host: HostStep) -> torch.Tensor:
        """Hidden states [M, hidden] of the step's output rows (`fits(host)`)."""
        b, q = len(host.query_lens), int(host.query_lens[0])
        bs = next(x for x in self.buckets[q] if x >= b)
        self._fill(host, q, bs)
        if (q, bs) in self.graphs:
            self.graphs[q, bs].replay()
            out = self.outputs[q, bs]
        else:
            out = self._forward(q, bs)
        # NOTE: the graph's output buffer is overwritten by the next replay; the step's readers get their own copy
        if host.output_rows is None:
            return out[:b * q].clone()
        return out.index_select(0, self.out_rows[:len(host.output_rows)])

    def dry_run(self, q: int = 0, bs: int = 0) -> torch.Tensor:
        """The forward a graph of shape (q, bs) (0, 0: the most tokens) captures, run eagerly on padding rows alone:
        the capture's warm-up, and the KV budget's estimate of the graphs' memory (tokenrouter/engine/kv_budget.py)."""
        q, bs = (q, bs) if q else self.shapes[0]
        self._fill(None, q, bs)
        return self._forward(q, bs)

    def _forward(self, q: int, bs: int) -> torch.Tensor:
        # what a graph captures: metadata over the static buffers' first bs rows (bs * q tokens), then the model
        n = bs * q
        meta = AttentionMetadata(slot_mapping=self.slots[:n].long(), query_start_loc=self.starts[q][:bs + 1],
                                 seq_lens=self.lens[:bs], block_tables=self.tables[:bs], num_seqs=bs, max_query_len=q)
        self.backend.prepare(meta, self.block_size)
        return self.model(self.ids[:n], self.pos[:n], self.kv_cache, meta)

    def _fill(self, host: HostStep | None, q: int, bs: int) -> None:
        """Write rows 0 .. bs-1 of the static inputs (real rows, then padding) in one host-to-device copy."""
        t, r, w = self.max_tokens, self.max_rows, self.max_blocks
        used = 4 * t + r + bs * w  # everything up to the bucket's block tables
        staging = self.staging.host(used)
        ids, pos, slots, out_rows = (staging[i * t:(i + 1) * t] for i in range(4))
        lens, tables = staging[4 * t:4 * t + r], staging[4 * t + r:used].reshape(bs, w)
        b = 0 if host is None else len(host.query_lens)
        n = b * q
        tables.fill(self.scratch_block)
        padding = np.arange(bs * q - n) % q  # the padded rows' positions: 0 .. q-1 each
        ids[n:bs * q], pos[n:bs * q], lens[b:bs] = 0, padding, q
        slots[n:bs * q] = self.scratch_slot + padding % self.block_size
        if b:
            ids[:n], pos[:n], slots[:n], lens[:b] = host.input_ids, host.positions, host.slot_mapping, host.seq_lens
            tables[:b, :host.block_tables.shape[1]] = host.block_tables
            if host.output_rows is not None:
                out_rows[:len(host.output_rows)] = host.output_rows
        self.staging.copy_to(self.static[:used])

    def _capture_all(self) -> None:
        t, device = time.perf_counter(), self.static.device
        release(device)
        before = in_use(device)
        pool, stream = None, torch.cuda.Stream(device)  # NOTE: torch's default capture stream is on one device
        # NOTE: the most tokens first, so the smaller graphs reuse the largest one's memory in the shared pool
        for q, bs in self.shapes:
            self.dry_run(q, bs)  # warm-up outside capture: kernel compilation, autotuning, lazy allocations
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[q, bs] = self._forward(q, bs)
            pool = graph.pool() if pool is None else pool
            self.graphs[q, bs] = graph
        release(device)  # the warm-ups' cached blocks are the eager steps' (the KV budget's activations)
        self.memory = in_use(device) - before
        shapes = "; ".join(f"{q} token{'s' if q > 1 else ''} a row, batch {','.join(map(str, bss))}"
                           for q, bss in self.buckets.items())
        log.info("captured %d CUDA graphs (%s) in %.1f s, %.0f MiB of graph memory",
                 len(self.graphs), shapes, time.perf_counter() - t, self.memory / 2**20)
