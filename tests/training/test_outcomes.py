"""Task-outcome labels for query-level routers on the tiny pair: answers through the engine (cached), checks,
prompt representations, labels, the split, and the train / calibrate CLIs on them."""
from __future__ import annotations

import pytest
import torch
import yaml

import tokenrouter
from tokenrouter.policies import make_policy
from tokenrouter.policies.checkpoint import load_router
from tokenrouter.training.outcomes import OutcomeTask, code_tasks, collect, split, word_problems

PAIR = "config/tiny/pair.yaml"


def parity_tasks(n: int = 32) -> list[OutcomeTask]:
    """Tiny random models solve nothing: these tasks "pass" when the answer's length is even, so the two
    models' answers split the tasks into every outcome."""
    return [OutcomeTask(f"t{i}", f"task {i}: {'xyz' * (i % 7)}", lambda text: len(text) % 2 == 0, 8 + i % 5)
            for i in range(n)]


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    root = tmp_path_factory.mktemp("outcomes")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENROUTER_CACHE", str(root / "cache"))
        from tokenrouter.config import load_config
        from tokenrouter.training.dataset import Pair

        pair = Pair(load_config(PAIR))
        yield collect(PAIR, pair, parity_tasks(), concurrency=4, log=lambda _: None), pair, root, mp


def test_answers_are_both_models_alone_and_checked(found):
    outcomes, pair, _, _ = found
    with tokenrouter.serve(PAIR) as svc:
        small = svc.generate_batch([{"prompt": t.prompt, "max_tokens": t.max_tokens} for t in parity_tasks()],
                                   policy="all-small")
        large = svc.generate_batch([{"prompt": t.prompt, "max_tokens": t.max_tokens} for t in parity_tasks()],
                                   policy="all-large")
    assert outcomes.small_answers == [o.token_ids for o in small]
    assert outcomes.small_passed.tolist() == [len(o.text) % 2 == 0 for o in small]
    assert outcomes.large_passed.tolist() == [len(o.text) % 2 == 0 for o in large]
    assert outcomes.prompts == [svc.encode(t.prompt) for t in parity_tasks()]


def test_prompt_representation_is_what_query_classifier_reads_at_serving(found):
    from tokenrouter.engine.block_manager import BlockManager, KVState
    from tokenrouter.engine.model_runner import Chunk

    outcomes, pair, _, _ = found
    blocks = BlockManager(pair.small.num_blocks, pair.small.block_size)
    for i in (0, 5):  # a plain prefill step of the prompt, as the engine runs it before the decision
        kv = KVState()
        blocks.allocate(kv, len(outcomes.prompts[i]))
        step = pair.small.run([Chunk(outcomes.prompts[i], 0, kv.block_table)])
        blocks.free(kv)
        torch.testing.assert_close(outcomes.hidden[i], step.hidden[0].float())


def test_labels_and_split(found):
    outcomes = found[0]
    helps = outcomes.labels("large-helps").bool()
    fails = outcomes.labels("small-fails").bool()
    assert helps.tolist() == (outcomes.large_passed & ~outcomes.small_passed).tolist()
    assert fails.tolist() == (~outcomes.small_passed).tolist()
    assert 0 < int(helps.sum()) < int(fails.sum()) < len(fails)
    with pytest.raises(ValueError, match="outcome_label"):
        outcomes.labels("large-wins")
    parts = split(outcomes, "large-helps", (0.25, 0.25), seed=0)
    assert {k: v.prompts for k, v in parts.items()} == {"train": 16, "calibrate": 8, "evaluate": 8}
    assert sum(float(v.prompt_labels.sum()) for v in parts.values()) == float(helps.sum())
    assert all(v.prompt_features["hidden"].shape == (v.prompts, 64) for v in parts.values())


def test_answers_are_cached(found, monkeypatch):
    outcomes, pair, root, _ = found
    monkeypatch.setenv("TOKENROUTER_CACHE", str(root / "cache"))

    def refuse(*args, **kwargs):
        raise AssertionError("the engine was started again")

    monkeypatch.setattr(tokenrouter, "serve", refuse)
    again = collect(PAIR, pair, parity_tasks(), log=lambda _: None)
    assert again.small_answers == outcomes.small_answers
    assert torch.equal(again.large_passed, outcomes.large_passed)


def test_code_tasks_and_word_problems_check_answers():
    tasks = code_tasks(split="dev")
    assert len(tasks) == 34 and all(t.task_id.startswith("TokenRouter/") for t in tasks)
    from tokenrouter.bench.humaneval import load_tasks

    first = load_tasks(split="dev")[0]
    assert tasks[0].check(f"```python\n{first.prompt}{first.canonical_solution}```")
    assert not tasks[0].check(f"```python\n{first.prompt}    return None\n```")
    problems = word_problems(8, seed=1)
    assert len({p.prompt for p in problems}) == 8
    from tokenrouter.bench.workloads import math_problems

    answer = math_problems(8, seed=1)[3].answer
    assert problems[3].check(f"So the result is\nAnswer: {answer:g}")
    assert not problems[3].check(f"Answer: {answer + 1:g}")


def test_train_and_calibrate_clis_on_task_outcomes(found, tmp_path):
    outcomes, _, root, mp = found
    from tokenrouter.training import calibrate, train

    mp.setattr(train, "outcome_tasks", lambda args: parity_tasks())
    mp.setattr(calibrate, "outcome_tasks", lambda args: parity_tasks())
    common = ["--config", PAIR, "--holdout", "0.25,0.25", "--concurrency", "4"]
    results = train.main([*common, "--kind", "query", "--epochs", "8", "--target-share", "0.25",
                          "--out", str(tmp_path / "{kind}.pt")])
    net, meta = load_router(tmp_path / "query.pt", "query")
    assert meta["data"]["outcomes"]["label"] == "large-helps"
    assert meta["data"]["outcomes"]["tasks"] == 32
    assert meta["data"]["prompts"] == {"train": 16, "calibrate": 8, "evaluate": 8}
    assert results["query"]["calibration"]["share"] == pytest.approx(0.25, abs=0.01)
    policy = make_policy("query-classifier", path=str(tmp_path / "query.pt"))
    assert policy.threshold == pytest.approx(meta["threshold"])

    spec = "query-confidence:tokens=2"
    cal = calibrate.main([*common, "--policy", spec, "--policy", "query-confidence", "--share", "0.25",
                          "--write", str(tmp_path)])
    assert cal[spec]["calibrated_on"] == "task outcomes"
    block = yaml.safe_load((tmp_path / "query-confidence-first2.yaml").read_text())["policy"]
    assert block["params"]["tokens"] == 2
    first = make_policy(block["name"], **block["params"])
    assert first.decides_after == 2 and first.threshold == pytest.approx(cal[spec]["score_threshold"])
    assert (tmp_path / "query-confidence.yaml").is_file()
