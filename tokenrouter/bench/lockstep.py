"""Baseline: lockstep routing, the design of the R2R paper's first implementation. The whole batch steps
the home (small) model, the policy picks rows, the target model extends just those rows, and everyone
waits for both before the next step. Same workers, policy and sampler as the engine, through the same
step messages, so it runs under every placement."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.executor import Executor
from tokenrouter.engine.messages import Row, StepResult
from tokenrouter.engine.scheduler import Batch
from tokenrouter.engine.sequence import SamplingParams, Sequence, TokenRecord
from tokenrouter.policies import Policy


def generate_lockstep(executors: dict[str, Executor], blocks: dict[str, BlockManager], eos_ids: set[int],
                      requests: list[tuple[list[int], SamplingParams]], policy: Policy,
                      concurrency: int, usage: dict | None = None,
                      on_finished: Callable[[Sequence], None] | None = None) -> list[Sequence]:
    """Runs `requests` with at most `concurrency` in the batch; a finished row's slot is refilled. `usage`, if
    given, collects per model {"steps", "tokens", "busy_seconds"}; `on_finished` sees each sequence as it ends."""
    if policy.decides_after:
        raise ValueError(f"policy: {policy.describe()} restarts responses after reading their first tokens; "
                         "the lockstep baseline steps every row at one home and cannot run it")
    if policy.verifies:
        raise ValueError(f"policy: {policy.describe()} verifies drafts and rolls sequences back; the lockstep "
                         "baseline extends every row by one token a step and cannot run it")
    models = list(executors)
    home, target = policy.home(models), policy.target(models)
    queue = deque(Sequence(list(ids), params, policy, home) for ids, params in requests)
    done: list[Sequence] = list(queue)
    batch: list[Sequence] = []
    try:
        while queue or batch:
            while queue and len(batch) < concurrency:
                batch.append(queue.popleft())
            out = forward(executors[home], blocks[home], batch, home, True, usage)
            sent = [i for i, s in enumerate(out.send) if s]
            tokens = list(out.tokens)
            if sent:
                out_large = forward(executors[target], blocks[target], [batch[i] for i in sent], target, False, usage)
                for i, token in zip(sent, out_large.tokens):
                    tokens[i] = token
            for i, (seq, token) in enumerate(zip(batch, tokens)):
                seq.token_ids.append(token)
                writer = target if i in sent else home
                seq.records.append(TokenRecord(token, "", writer, out.scores[i], time.perf_counter() - seq.arrival))
            ended = [s for s in batch if finished(s, eos_ids)]
            for seq in ended:
                release(executors, blocks, seq)
                if on_finished is not None:
                    on_finished(seq)
            batch = [s for s in batch if s not in ended]
    finally:
        for seq in done:
            release(executors, blocks, seq)
    return done


def finished(seq: Sequence, eos_ids: set[int]) -> bool:
    token, params = seq.token_ids[-1], seq.params
    stop = token in params.stop_token_ids or (token in eos_ids and not params.ignore_eos)
    return stop or seq.num_output_tokens >= params.max_tokens


def release(executors: dict[str, Executor], blocks: dict[str, BlockManager], seq: Sequence) -> None:
    """Free `seq`'s blocks in every model and let its workers forget it."""
    for name, kv in seq.kv.items():
        blocks[name].free(kv)
    for executor in executors.values():
        executor.forget(seq)


def forward(executor: Executor, blocks: BlockManager, seqs: list[Sequence], model: str, route: bool,
            usage: dict | None = None, verify: bool = False) -> StepResult:
    """One step of `model` over everything `seqs` miss there; `route`: its policy decides at each row;
    `verify`: it judges each row's drafts (engine/verification.py)."""
    batch = Batch()
    for seq in seqs:
        kv = seq.kv_at(model)
        blocks.allocate(kv, len(seq.token_ids))
        batch.add(seq, Row(seq.seq_id, seq.token_ids[kv.num_cached:], kv.num_cached, kv.block_table, True, route,
                           seq.settled if verify and seq.num_drafts else 0))
    out = executor.run(executor.request(batch))
    if usage is not None:
        u = usage.setdefault(model, {"steps": 0, "tokens": 0, "busy_seconds": 0.0})
        u["steps"] += 1
        u["tokens"] += sum(len(row.token_ids) for row in batch.rows)
        u["busy_seconds"] += out.seconds
    for seq, row in zip(seqs, batch.rows):
        seq.kv_at(model).num_cached += len(row.token_ids)
        seq.tokens_computed[model] = seq.tokens_computed.get(model, 0) + len(row.token_ids)
    return out
