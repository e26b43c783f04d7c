"""Baseline: lockstep routing, the design of the R2R paper's first implementation. The whole batch steps
the home (small) model, the policy picks rows, the target model extends just those rows, and everyone
waits for both before the next step. Same runners, policy and sampler as the engine."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.model_runner import Chunk, ModelRunner
from tokenrouter.engine.sampler import sample
from tokenrouter.engine.sequence import SamplingParams, Sequence, TokenRecord
from tokenrouter.policies import Policy, StepFeatures


def generate_lockstep(runners: dict[str, ModelRunner], blocks: dict[str, BlockManager], eos_ids: set[int],
                      requests: list[tuple[list[int], SamplingParams]], policy: Policy,
                      concurrency: int, usage: dict | None = None,
                      on_finished: Callable[[Sequence], None] | None = None) -> list[Sequence]:
    """Runs `requests` with at most `concurrency` in the batch; a finished row's slot is refilled. `usage`, if
    given, collects per model {"steps", "tokens", "busy_seconds"}; `on_finished` sees each sequence as it ends."""
    if policy.decides_after:
        raise ValueError(f"policy: {policy.describe()} restarts responses after reading their first tokens; "
                         "the lockstep baseline steps every row at one home and cannot run it")
    models = list(runners)
    home, target = policy.home(models), policy.target(models)
    queue = deque(Sequence(list(ids), params, policy, home) for ids, params in requests)
    done: list[Sequence] = list(queue)
    batch: list[Sequence] = []
    try:
        while queue or batch:
            while queue and len(batch) < concurrency:
                batch.append(queue.popleft())
            out = forward(runners[home], blocks[home], batch, home, usage)
            sends, scores = policy.route(StepFeatures(out.logits, out.hidden, batch, runners[home].model.embed_tokens))
            sent = [i for i, s in enumerate(sends) if s and target != home]
            logits = out.logits.clone()
            if sent:
                out_large = forward(runners[target], blocks[target], [batch[i] for i in sent], target, usage)
                logits[sent] = out_large.logits
            tokens = sample(logits, [s.params for s in batch], [len(s.token_ids) for s in batch])
            for i, (seq, token) in enumerate(zip(batch, tokens)):
                seq.token_ids.append(token)
                writer = target if i in sent else home
                seq.records.append(TokenRecord(token, "", writer, scores[i], time.perf_counter() - seq.arrival))
            ended = [s for s in batch if finished(s, eos_ids)]
            for seq in ended:
                _free(blocks, seq)
                if on_finished is not None:
                    on_finished(seq)
            batch = [s for s in batch if s not in ended]
    finally:
        for seq in done:
            _free(blocks, seq)
    return done


def finished(seq: Sequence, eos_ids: set[int]) -> bool:
    token, params = seq.token_ids[-1], seq.params
    stop = token in params.stop_token_ids or (token in eos_ids and not params.ignore_eos)
    return stop or seq.num_output_tokens >= params.max_tokens


def _free(blocks: dict[str, BlockManager], seq: Sequence) -> None:
    for name, kv in seq.kv.items():
        blocks[name].free(kv)


def forward(runner: ModelRunner, blocks: BlockManager, seqs: list[Sequence], model: str, usage: dict | None = None):
    chunks = []
    for seq in seqs:
        kv = seq.kv_at(model)
        blocks.allocate(kv, len(seq.token_ids))
        chunks.append(Chunk(seq.token_ids[kv.num_cached:], kv.num_cached, kv.block_table))
    t = time.perf_counter()
    out = runner.run(chunks)
    if usage is not None:
        u = usage.setdefault(model, {"steps": 0, "tokens": 0, "busy_seconds": 0.0})
        u["steps"] += 1
        u["tokens"] += sum(len(c.token_ids) for c in chunks)
        u["busy_seconds"] += time.perf_counter() - t
    for seq, chunk in zip(seqs, chunks):
        seq.kv_at(model).num_cached += len(chunk.token_ids)
        seq.tokens_computed[model] = seq.tokens_computed.get(model, 0) + len(chunk.token_ids)
    return out
