"""Paged KV cache bookkeeping for one model: a pool of fixed-size blocks and per-sequence block tables.

Pure Python, no torch: the scheduler plans with it, the model runner only reads block tables.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class OutOfBlocks(RuntimeError):
    """The KV block pool cannot hold what was asked; nothing was allocated."""


@dataclass(slots=True)
class KVState:
    """One sequence's cache in one model.

    NOTE: `num_cached` is the KV watermark: tokens `0 .. num_cached - 1` of the sequence have their keys
    and values in this model's cache. It moves forward only after a step wrote those keys (the runtime's
    `postprocess`, or a baseline's own loop), and back only here: to 0 when the blocks are freed, or to a
    rollback's cut (`truncate`); a model
    that gets a sequence back computes just the tokens from its watermark on (`Runtime.handoff`).
    """
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, kv: KVState, num_tokens: int) -> int:
        """Blocks to add to `kv` so that its table holds `num_tokens` tokens."""
        needed = -(-num_tokens // self.block_size) - len(kv.block_table)
        return needed if needed > 0 else 0

    def can_allocate(self, kv: KVState, num_tokens: int) -> bool:
        return self.blocks_needed(kv, num_tokens) <= len(self.free_blocks)

    def allocate(self, kv: KVState, num_tokens: int) -> None:
        needed = self.blocks_needed(kv, num_tokens)
        if needed == 0:  # most steps: the sequence's last block has room
            return
        if needed > len(self.free_blocks):
            raise OutOfBlocks(f"KV cache exhausted: {num_tokens} tokens need {needed} more blocks of "
                              f"{self.block_size}, {len(self.free_blocks)} of {self.num_blocks} are free")
        kv.block_table.extend(self.free_blocks.popleft() for _ in range(needed))

    def truncate(self, kv: KVState, num_tokens: int) -> None:
        """Cut `kv` back to its first `num_tokens` tokens (a rollback): the watermark moves back to at most
        `num_tokens` and the blocks past them return to the pool. The cached keys before the cut stay valid."""
        keep = -(-num_tokens // self.block_size)
        self.free_blocks.extend(kv.block_table[keep:])
        del kv.block_table[keep:]
        kv.num_cached = min(kv.num_cached, num_tokens)

    def free(self, kv: KVState) -> None:
        self.free_blocks.extend(kv.block_table)
        kv.block_table.clear()
        kv.num_cached = 0
