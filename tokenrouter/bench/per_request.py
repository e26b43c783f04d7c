"""Baseline: the per-request loop of most paper code (CITER, Co-LLM): one request at a time, switching
models per token, each model with its own cache of that request. Same workers, policy and sampler as
the engine, so a deterministic policy gives the same tokens; only the time differs."""
from __future__ import annotations

import time

from tokenrouter.bench.lockstep import finished, forward, release
from tokenrouter.engine.block_manager import BlockManager
from tokenrouter.engine.executor import Executor
from tokenrouter.engine.sequence import SamplingParams, Sequence, TokenRecord
from tokenrouter.engine.verification import apply, judged_from
from tokenrouter.policies import Policy


def generate_one(executors: dict[str, Executor], blocks: dict[str, BlockManager], eos_ids: set[int],
                 prompt_ids: list[int], params: SamplingParams, policy: Policy) -> Sequence:
    models = list(executors)
    home, target = policy.home(models, list(prompt_ids)), policy.target(models)
    seq = Sequence(list(prompt_ids), params, policy, home, verifier=target if policy.verifies else "")

    def append(token: int, writer: str, score: float, correction: bool = False) -> None:
        seq.token_ids.append(token)
        if writer != seq.home or not seq.verifier:
            seq.settled = len(seq.token_ids)
        score = score if seq.decided is None else seq.decided
        seq.records.append(TokenRecord(token, "", writer, score, time.perf_counter() - seq.arrival,
                                       correction=correction))

    def visit(score: float) -> bool:
        """The target catches up, judges the drafts (a verifying policy) and writes its token; True: finished."""
        start = seq.kv_at(target).num_cached
        verify_from = seq.settled if seq.num_drafts else 0
        out = forward(executors[target], blocks[target], [seq], target, False, verify=True)
        correction = False
        if verify_from:  # as the engine's Runtime.settle
            correction = apply(seq, judged_from(verify_from, start), out.accepted[0], blocks,
                               out.tolerated[0] if out.tolerated else ())
            if not correction and finished(seq, eos_ids):
                return True
        append(out.tokens[0], target, score, correction)
        return finished(seq, eos_ids)

    try:
        while True:
            # as the engine: once a query-level send moved the home, the policy is not asked again
            out = forward(executors[home], blocks[home], [seq], home, seq.decided is None)
            if out.send[0] and policy.moves_home:  # as the engine: the target writes the whole response
                blocks[home].free(seq.kv.pop(home))  # (dropping the tokens the policy read first)
                seq.discarded += seq.num_output_tokens
                del seq.token_ids[len(prompt_ids):]
                seq.records.clear()
                seq.settled = len(prompt_ids)
                home = seq.home = target
                seq.decided = out.scores[0]
                continue
            if out.send[0]:
                done = visit(out.scores[0])
            else:
                append(out.tokens[0], home, out.scores[0])
                done = finished(seq, eos_ids)
                if seq.num_drafts and (done or seq.num_drafts >= policy.draft_limit):
                    done = visit(float("nan"))
            if done:
                return seq
    finally:
        release(executors, blocks, seq)
