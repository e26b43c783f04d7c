"""Baseline: the per-request loop of most paper code (CITER, Co-LLM): one request at a time, switching
models per token, each model with its own cache of that request. Same runners, policy and sampler as
the engine, so a deterministic policy gives the same tokens; only the time differs."""
from __future__ import annotations

import time

from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.model_runner import Chunk, ModelRunner
from tokenrouter.engine.sampler import sample
from tokenrouter.engine.sequence import SamplingParams, Sequence, TokenRecord
from tokenrouter.policies import Policy, StepFeatures


def generate_one(runners: dict[str, ModelRunner], blocks: dict[str, BlockManager], eos_ids: set[int],
                 prompt_ids: list[int], params: SamplingParams, policy: Policy) -> Sequence:
    models = list(runners)
    home = policy.home(models)
    seq = Sequence(list(prompt_ids), params, policy, home)
    try:
        while True:
            out = _forward(runners[home], blocks[home], seq, home)
            features = StepFeatures(out.logits, out.hidden, [seq])
            sends, scores = policy.route(features)
            writer, target = home, policy.target(models)
            if sends[0] and target != home:
                writer = target
                out = _forward(runners[target], blocks[target], seq, target)
            token = sample(out.logits, [params], [len(seq.token_ids)])[0]
            seq.token_ids.append(token)
            seq.records.append(TokenRecord(token, "", writer, scores[0], time.perf_counter() - seq.arrival))
            stop = token in params.stop_token_ids or (token in eos_ids and not params.ignore_eos)
            if stop or seq.num_output_tokens >= params.max_tokens:
                return seq
    finally:
        for name, kv in seq.kv.items():
            blocks[name].free(kv)


def _forward(runner: ModelRunner, blocks: BlockManager, seq: Sequence, model: str):
    kv = seq.kv_at(model)
    n = len(seq.token_ids) - kv.num_cached
    blocks.allocate(kv, len(seq.token_ids))
    out = runner.run([Chunk(seq.token_ids[kv.num_cached:], kv.num_cached, kv.block_table)])
    kv.num_cached += n
    seq.tokens_computed[model] = seq.tokens_computed.get(model, 0) + n
    return out
