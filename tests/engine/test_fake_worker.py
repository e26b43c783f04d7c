"""The runtime, subservers and schedulers on fake workers (scripted tokens and decisions, no model):
catch-up arithmetic, hand-offs in a three-model cascade, preemption under a small KV pool."""
from __future__ import annotations

import asyncio

from tokenrouter.config import EngineConfig, ModelSpec, SchedulerSpec
from tokenrouter.engine.fake_worker import default_token, fake_executors
from tokenrouter.engine.runtime import Runtime
from tokenrouter.engine.sequence import SamplingParams
from tokenrouter.models.tiny import byte_tokenizer
from tokenrouter.policies import Policy


class Middle(Policy):
    """Sends to the second of three models (a cascade's middle); the fake worker decides when."""
    name = "middle"

    def target(self, models):
        return models[1]


def serve(models: list[str], prompts: list[list[int]], max_tokens: int, policy: Policy, scheduler=None, **fake):
    config = EngineConfig([ModelSpec(m, "fake") for m in models], scheduler=scheduler or SchedulerSpec())
    executors = fake_executors(models, **fake)

    async def main():
        runtime = Runtime(config, executors, byte_tokenizer())
        runtime.start()
        seqs = [runtime.submit(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), policy) for p in prompts]
        for seq in seqs:
            while await seq.stream.get() is not None:
                pass
        runtime.close()
        return runtime, seqs

    runtime, seqs = asyncio.run(main())
    return runtime, seqs, {m: e.worker for m, e in executors.items()}


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    class View:
        token_ids = list(prompt)

    for _ in range(max_tokens):
        View.token_ids.append(default_token(View, ""))
    return View.token_ids[len(prompt):]


def every_third(view, model) -> bool:
    return view.num_output_tokens % 3 == 2


def test_each_model_computes_exactly_the_tokens_it_missed():
    prompt = list(range(10, 30))
    runtime, (seq,), workers = serve(["small", "large"], [prompt], 12, Middle(), send=every_third)
    assert seq.output_ids == reference(prompt, 12)
    assert [r.model for r in seq.records] == ["large" if i % 3 == 2 else "small" for i in range(12)]
    # large: each visit starts at its own watermark and ends at the sequence's last token
    large_rows = [(r.start, len(r.token_ids)) for r in workers["large"].rows]
    assert large_rows == [(0, 22), (22, 3), (25, 3), (28, 3)]
    assert seq.tokens_computed == {"small": 20 + 12 - 1, "large": 31}
    assert all(s.blocks.num_free_blocks == s.blocks.num_blocks for s in runtime.subservers.values())


def test_a_three_model_cascade_hands_off_to_the_middle_model():
    prompts = [list(range(5, 5 + n)) for n in (3, 9, 17)]
    runtime, seqs, workers = serve(["a", "b", "c"], prompts, 9, Middle(), send=every_third)
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_ids == reference(prompt, 9)
        assert {r.model for r in seq.records} == {"a", "b"}
    assert not workers["c"].rows  # nobody sends to the last model
    assert all(s.blocks.num_free_blocks == s.blocks.num_blocks for s in runtime.subservers.values())


def test_preemption_under_a_small_pool_recomputes_and_frees_every_block():
    prompts = [list(range(3, 3 + 6 + i)) for i in range(8)]
    runtime, seqs, workers = serve(["small", "large"], prompts, 20, Middle(), send=every_third, num_blocks=24,
                                   block_size=4, scheduler=SchedulerSpec(max_num_seqs=8))
    assert runtime.subservers["small"].scheduler.num_preemptions > 0
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_ids == reference(prompt, 20)
    assert all(s.blocks.num_free_blocks == s.blocks.num_blocks for s in runtime.subservers.values())
