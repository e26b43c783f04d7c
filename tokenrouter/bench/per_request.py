"""Baseline: the per-request loop of most paper code (CITER, Co-LLM): one request at a time, switching
models per token, each model with its own cache of that request. Same workers, policy and sampler as
the engine, so a deterministic policy gives the same tokens; only the time differs."""
from __future__ import annotations

import time

from tokenrouter.bench.lockstep import finished, forward, release
from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.executor import Executor
from tokenrouter.engine.sequence import SamplingParams, Sequence, TokenRecord
from tokenrouter.policies import Policy


def generate_one(executors: dict[str, Executor], blocks: dict[str, BlockManager], eos_ids: set[int],
                 prompt_ids: list[int], params: SamplingParams, policy: Policy) -> Sequence:
    models = list(executors)
    home = policy.home(models, list(prompt_ids))
    seq = Sequence(list(prompt_ids), params, policy, home)
    try:
        while True:
            # as the engine: once a query-level send moved the home, the policy is not asked again
            out = forward(executors[home], blocks[home], [seq], home, seq.decided is None)
            writer, target = home, policy.target(models)
            if out.send[0] and policy.moves_home:  # as the engine: the target writes the whole response
                blocks[home].free(seq.kv.pop(home))  # (dropping the tokens the policy read first)
                seq.discarded += seq.num_output_tokens
                del seq.token_ids[len(prompt_ids):]
                seq.records.clear()
                home = seq.home = target
                seq.decided = out.scores[0]
                continue
            token = out.tokens[0]
            if out.send[0]:
                writer = target
                token = forward(executors[target], blocks[target], [seq], target, False).tokens[0]
            score = out.scores[0] if seq.decided is None else seq.decided
            seq.token_ids.append(token)
            seq.records.append(TokenRecord(token, "", writer, score, time.perf_counter() - seq.arrival))
            if finished(seq, eos_ids):
                return seq
    finally:
        release(executors, blocks, seq)
