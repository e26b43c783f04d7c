"""One step's model inputs, built from its chunks with numpy and moved to the device in one copy.

Every per-token field is computed by array arithmetic (no Python loop over tokens); the only loop is over
chunks, to read their token ids and block tables. All fields travel as one int32 array: on CUDA through a
pinned host buffer and one non-blocking copy, on a CPU as views of the numpy array itself (no copy at all).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from tokenrouter.models.attention import AttentionBackend, AttentionMetadata


@dataclass(slots=True)
class HostStep:
    """A step's inputs on the host: [N] per token, [B] per chunk, [M] per output row."""
    input_ids: np.ndarray  # [N]
    positions: np.ndarray  # [N]
    slot_mapping: np.ndarray  # [N]
    query_lens: np.ndarray  # [B]
    query_start_loc: np.ndarray  # [B + 1] row of chunk i's first token
    seq_lens: np.ndarray  # [B] context length once the chunk's tokens are in
    block_tables: np.ndarray  # [B, W] W = the longest context's blocks
    output_rows: np.ndarray | None  # [M] token rows whose hidden state and logits the step returns; None: all
    offsets: list[int]  # row of chunk i's first output


def build_host_step(chunks, block_size: int, max_model_len: int) -> HostStep:
    """Check the chunks (ValueError naming the problem) and lay out their inputs."""
    b = len(chunks)
    if b == 0:
        raise ValueError("a step needs at least one chunk")
    query_lens = np.fromiter((len(c.token_ids) for c in chunks), np.int64, b)
    starts = np.fromiter((c.start for c in chunks), np.int64, b)
    num_outputs = np.fromiter((c.num_outputs for c in chunks), np.int64, b)
    table_lens = np.fromiter((len(c.block_table) for c in chunks), np.int64, b)
    seq_lens = starts + query_lens
    _check(query_lens, seq_lens, num_outputs, table_lens * block_size, max_model_len)
    n = int(query_lens.sum())
    blocks = -(-seq_lens // block_size)
    tables = np.zeros((b, int(blocks.max())), np.int64)
    for i, c in enumerate(chunks):
        tables[i, :blocks[i]] = c.block_table[:blocks[i]]
    first = np.zeros(b + 1, np.int64)
    np.cumsum(query_lens, out=first[1:])
    input_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int64, n)
    row_chunk = np.repeat(np.arange(b), query_lens)  # [N] chunk of each token row
    positions = np.arange(n) + (starts - first[:-1])[row_chunk]
    slots = tables[row_chunk, positions // block_size] * block_size + positions % block_size
    m = int(num_outputs.sum())
    out_first = np.cumsum(num_outputs) - num_outputs
    rows = None
    if m != n:  # output rows ascend, so as many as the tokens means every row (a decode step): no gather needed
        rows = np.repeat(first[1:] - num_outputs - out_first, num_outputs) + np.arange(m)
    return HostStep(input_ids, positions, slots, query_lens, first, seq_lens, tables, rows, out_first.tolist())


def _check(query_lens, seq_lens, num_outputs, table_slots, max_model_len: int) -> None:
    problems = [
        (query_lens < 1, lambda i: "a chunk needs at least one token"),
        (seq_lens > max_model_len,
         lambda i: f"sequence length {seq_lens[i]} exceeds max_model_len={max_model_len}"),
        (table_slots < seq_lens, lambda i: f"block table holds {table_slots[i]} slots, chunk needs {seq_lens[i]}"),
        ((num_outputs < 1) | (num_outputs > query_lens),
         lambda i: f"num_outputs must be in [1, {query_lens[i]}], got {num_outputs[i]}"),
    ]
    for bad, message in problems:
        if bad.any():
            raise ValueError(message(int(np.flatnonzero(bad)[0])))


class StepInputs:
    """Moves a HostStep to the device as model inputs and attention metadata (one copy)."""

    def __init__(self, device: torch.device, backend: AttentionBackend, block_size: int):
        self.device, self.backend, self.block_size = device, backend, block_size
        self.staging = Staging(device)

    def to_device(self, host: HostStep):
        """(input_ids [N], positions [N], metadata, output_rows [M] or None): device tensors over one int32 array."""
        n, b, w = len(host.input_ids), len(host.query_lens), host.block_tables.shape[1]
        parts = [host.input_ids, host.positions, host.slot_mapping, host.query_start_loc, host.seq_lens,
                 host.block_tables.ravel()]
        if host.output_rows is not None:
            parts.append(host.output_rows)
        flat = self._upload(parts)
        sizes = [n, n, n, b + 1, b, b * w, len(host.output_rows) if host.output_rows is not None else 0]
        ids, pos, slots, qsl, lens, tables, rows = flat.split(sizes)
        meta = AttentionMetadata(
            slot_mapping=slots.long(), query_start_loc=qsl, seq_lens=lens, block_tables=tables.view(b, w),
            num_seqs=b, max_query_len=int(host.query_lens.max()), query_lens=host.query_lens,
            context_lens=host.seq_lens, block_tables_host=host.block_tables)
        self.backend.prepare(meta, self.block_size)
        return ids, pos, meta, (rows.long() if host.output_rows is not None else None)

    def _upload(self, parts: list[np.ndarray]) -> torch.Tensor:
        total = sum(len(p) for p in parts)
        if self.device.type == "cpu":
            return torch.from_numpy(np.concatenate(parts).astype(np.int32))
        np.concatenate(parts, out=self.staging.host(total), casting="unsafe")
        out = torch.empty(total, dtype=torch.int32, device=self.device)
        self.staging.copy_to(out)
        return out


class Staging:
    """A pinned host buffer of int32 copied to the device without blocking the host.
    NOTE: the buffer is reused; `host()` first waits for the last copy out of it, so a step whose results nobody
    read back (a timing loop) cannot have its inputs overwritten while they are still in flight."""

    def __init__(self, device: torch.device, size: int = 0):
        self.device = device
        self.pinned = torch.empty(size, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.copied: torch.cuda.Event | None = None
        self.size = size

    def host(self, n: int) -> np.ndarray:
        """The first n entries, writable once the last copy from them has finished."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None
        if self.pinned.numel() < n:
            self.pinned = torch.empty(max(n, 2 * self.pinned.numel()), dtype=torch.int32,
                                      pin_memory=self.device.type == "cuda")
        self.size = n
        return self.pinned[:n].numpy()

    def copy_to(self, dst: torch.Tensor) -> None:
        """Copy the entries last handed out by `host()` into `dst` (a device tensor of that size)."""
        if self.device.type != "cuda":
            dst.copy_(self.pinned[:self.size])
            return
        dst.copy_(self.pinned[:self.size], non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record(torch.cuda.current_stream(self.device))
