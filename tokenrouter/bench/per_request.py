"""Baseline: the per-request loop of most paper code (CITER, Co-LLM): one request at a time, switching
models per token, each model with its own cache of that request. Same runners, policy and sampler as
the engine, so a deterministic policy gives the same tokens; only the time differs."""
from __future__ import annotations

import time

from tokenrouter.bench.lockstep import finished, forward
from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.model_runner import ModelRunner
from tokenrouter.engine.sampler import sample
from tokenrouter.engine.sequence import SamplingParams, Sequence, TokenRecord
from tokenrouter.policies import Policy, StepFeatures


def generate_one(runners: dict[str, ModelRunner], blocks: dict[str, BlockManager], eos_ids: set[int],
                 prompt_ids: list[int], params: SamplingParams, policy: Policy) -> Sequence:
    models = list(runners)
    home = policy.home(models, list(prompt_ids))
    seq = Sequence(list(prompt_ids), params, policy, home)
    try:
        while True:
            out = forward(runners[home], blocks[home], [seq], home)
            features = StepFeatures(out.logits, out.hidden, [seq], runners[home].model.embed_tokens)
            sends, scores = policy.route(features)
            writer, target = home, policy.target(models)
            if sends[0] and target != home and policy.moves_home:  # as the engine: the target writes the
                blocks[home].free(seq.kv.pop(home))  # whole response (dropping tokens the policy read first)
                seq.discarded += seq.num_output_tokens
                del seq.token_ids[len(prompt_ids):]
                seq.records.clear()
                home = seq.home = target
                continue
            if sends[0] and target != home:
                writer = target
                out = forward(runners[target], blocks[target], [seq], target)
            token = sample(out.logits, [params], [len(seq.token_ids)])[0]
            seq.token_ids.append(token)
            seq.records.append(TokenRecord(token, "", writer, scores[0], time.perf_counter() - seq.arrival))
            if finished(seq, eos_ids):
                return seq
    finally:
        for name, kv in seq.kv.items():
            blocks[name].free(kv)
