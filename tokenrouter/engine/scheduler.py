"""Continuous batching for one model: running sequences first, then waiting ones (new or handed off),
prefill and catch-up in chunks under a token budget, preemption by recompute when blocks run out."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.messages import Row
from tokenrouter.engine.sequence import Sequence, SeqStatus


@dataclass(slots=True)
class Batch:
    """One step's rows, in order: the step message's Rows (each sequence's tokens from its watermark here, whether
    the row completes it, runs the policy, judges drafts) and, beside each, the driver's sequence it belongs to."""
    seqs: list[Sequence] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, seq: Sequence, row: Row) -> None:
        self.seqs.append(seq)
        self.rows.append(row)


class Scheduler:
    def __init__(self, model: str, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.model = model
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: dict[int, Sequence] = {}  # hold blocks here while another model has the sequence
        self.num_preemptions = 0

    @property
    def num_ready(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.parked.pop(seq.seq_id, None)
        seq.model, seq.status = self.model, SeqStatus.WAITING
        self.waiting.append(seq)

    def park(self, seq: Sequence) -> None:
        self._remove(seq)
        self.parked[seq.seq_id] = seq

    def drop(self, seq: Sequence) -> None:
        """Forget `seq` and free its blocks here (finish or abort)."""
        self._remove(seq)
        self.parked.pop(seq.seq_id, None)
        if self.model in seq.kv:
            self.blocks.free(seq.kv[self.model])

    def _remove(self, seq: Sequence) -> None:
        try:
            self.running.remove(seq)
        except ValueError:
            if seq in self.waiting:
                self.waiting.remove(seq)

    def schedule(self) -> Batch:
        batch = Batch()
        seqs, rows = batch.seqs, batch.rows
        budget, max_num_seqs, running = self.max_num_batched_tokens, self.max_num_seqs, SeqStatus.RUNNING
        for seq in list(self.running):
            if len(rows) >= max_num_seqs or budget <= 0:
                break
            if seq.status is not running:  # preempted for an earlier sequence of this batch (back to waiting)
                continue
            row = self._plan(seq, budget, batch)
            if row is not None:
                seqs.append(seq)
                rows.append(row)
                budget -= len(row.token_ids)
        while self.waiting and len(rows) < max_num_seqs and budget > 0:
            seq = self.waiting[0]
            row = self._plan(seq, budget, batch)
            if row is None:
                break
            self.waiting.popleft()
            seq.status = running
            self.running.append(seq)
            seqs.append(seq)
            rows.append(row)
            budget -= len(row.token_ids)
        return batch

    def _plan(self, seq: Sequence, budget: int, batch: Batch) -> Row | None:
        """`seq`'s row in this step, at most `budget` tokens, its blocks allocated; None: no row this step (nothing
        fits the budget, or no blocks can be found: a running sequence is then preempted)."""
        model = self.model
        kv = seq.kv_at(model)
        start, total, settled = kv.num_cached, len(seq.token_ids), seq.settled
        end = total if total - start <= budget else start + budget
        if end < total and total != settled and seq.verifier == model:
            # NOTE: a draft is judged by the logits at the position before it, and only the chunk that
            # completes the sequence returns logits: a split catch-up ends before the position that judges
            # the first draft, so the last chunk holds them all (the runtime bounds it by max_num_batched_tokens)
            end = min(end, max(start, settled - 1))
        if end == start:  # its verifying chunk does not fit what is left of this step: first in the next one
            return None
        if end > len(kv.block_table) * self.blocks.block_size:  # NOTE: most steps need no block (the last has room)
            needed = self.blocks.blocks_needed(kv, end)
            while needed > self.blocks.num_free_blocks:
                victim = self._victim(seq, batch)
                if victim is None:
                    if seq.status is SeqStatus.RUNNING:
                        self._preempt(seq)
                    return None
                self._preempt(victim)
            self.blocks.allocate(kv, end)
        complete = end == total
        # the policy runs on complete rows at home, until a query-level send decided the sequence for good; the
        # verifier judges the drafts of complete rows
        route = complete and seq.home == model and seq.decided is None
        verify = complete and total != settled and seq.verifier == model
        return Row(seq.seq_id, seq.token_ids[start:end], start, kv.block_table, complete, route,
                   settled if verify else 0)

    def _victim(self, seq: Sequence, batch: Batch) -> Sequence | None:
        """Parked sequences give their blocks up first, then waiting ones (a sequence handed back keeps its
        blocks while it waits), then the newest running one outside the batch."""
        in_batch = {s.seq_id for s in batch.seqs}
        for other in [*reversed(list(self.parked.values())), *reversed(self.waiting)]:
            if other is not seq and other.kv_at(self.model).block_table:
                return other
        for other in reversed(self.running):
            if other is not seq and other.seq_id not in in_batch and other.kv_at(self.model).block_table:
                return other
        return None

    def _preempt(self, seq: Sequence) -> None:
        # NOTE: recompute, not swap: the blocks go back to the pool and the watermark to 0, so the model
        # prefills the whole sequence again when it next runs it.
        self.blocks.free(seq.kv_at(self.model))
        self.num_preemptions += 1
        if seq in self.running:
            self.running.remove(seq)
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)
