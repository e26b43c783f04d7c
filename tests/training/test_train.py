"""The router training pipeline end to end on the tiny pair: labels (cached), training of the neural,
probe and query routers, calibration, checkpoints the engine loads, and the calibrate CLI."""
from __future__ import annotations

import json

import pytest
import yaml

import tokenrouter
from tokenrouter.bench.per_request import generate_one
from tokenrouter.policies import make_policy
from tokenrouter.policies.checkpoint import load_router

PAIR = "config/tiny/pair.yaml"
# random tiny models rarely agree: a low overlap bar leaves some neutral positions, and a low answer-match
# bar splits the prompts into both query classes (task outcomes, the default query labels, are tested in
# test_outcomes.py: tiny models pass no task)
LABELS = ["--config", PAIR, "--max-tokens", "16", "--continuation", "4", "--min-overlap", "0.25",
          "--query-match", "0.05", "--group", "8", "--holdout", "0.25,0.25", "--query-labels", "match"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"prompt {i}: {'abc' * (i % 5)}"}) + "\n" for i in range(24)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENROUTER_CACHE", str(root / "cache"))
        from tokenrouter.training import train

        results = train.main([*LABELS, "--prompts", str(prompts), "--epochs", "8", "--target-share", "0.3",
                              "--out", str(root / "{kind}.pt")])
        yield root, prompts, results, mp


def test_checkpoints_carry_pair_features_threshold_and_data(trained):
    root, _, results, _ = trained
    assert set(results) == {"neural", "probe", "query"}
    for kind in results:
        net, meta = load_router(root / f"{kind}.pt", kind)
        assert meta["pair"] == {"small": "tiny:qwen2-small", "large": "tiny:qwen2-large"}
        assert meta["features"] == {"neural": ["hidden", "token_embedding", "topk_logprobs"]}.get(kind, ["hidden"])
        assert net.inputs["hidden"] == 64
        assert 0 <= meta["threshold"] <= 1
        assert meta["target"] == {"share": 0.3}
        assert meta["data"]["prompts"] == {"train": 12, "calibrate": 6, "evaluate": 6}
        assert meta["data"]["labels"]["continuation"] == 4
        assert 0 <= meta["held_out"]["precision"] <= 1 and 0 <= meta["held_out"]["recall"] <= 1
        assert meta["command"].startswith("python -m tokenrouter.training.train")
    # token level: the threshold sends the target share of the calibration positions
    for kind in ("neural", "probe"):
        assert results[kind]["calibration"]["share"] == pytest.approx(0.3, abs=0.02)
        assert 0 < results[kind]["data"]["positions"]["calibrate"] <= 6 * 16


def test_labels_are_cached_and_reused(trained, monkeypatch):
    root, prompts, first, _ = trained
    from tokenrouter.training import dataset

    def refuse(*args, **kwargs):
        raise AssertionError("labels were made again")

    monkeypatch.setenv("TOKENROUTER_CACHE", str(root / "cache"))
    monkeypatch.setattr(dataset, "label_group", refuse)
    from tokenrouter.training import train

    again = train.main([*LABELS, "--prompts", str(prompts), "--kind", "probe", "--epochs", "2",
                        "--out", str(root / "again-{kind}.pt")])
    assert again["probe"]["data"] == first["probe"]["data"]


def test_the_engine_routes_with_the_trained_routers(trained):
    root = trained[0]
    with tokenrouter.serve(PAIR) as svc:
        subs = svc.runtime.subservers
        prompts = ["hello there", "def f(x):", "abcabc", "12345"]
        for spec in (f"neural:path={root / 'neural.pt'},threshold=0.5", f"probe:path={root / 'probe.pt'}"):
            policy = svc.policy(spec)
            outs = svc.generate_batch(prompts, policy=policy, max_tokens=8, ignore_eos=True)
            for prompt, out in zip(prompts, outs):
                ids, params, _ = svc.prepare(prompt, max_tokens=8, ignore_eos=True)
                ref = generate_one({m: subs[m].executor for m in svc.models}, {m: subs[m].blocks for m in svc.models},
                                   svc.runtime.eos_ids, ids, params, policy)
                assert out.token_ids == ref.output_ids
                assert [r.model for r in out.tokens] == [r.model for r in ref.records]
                assert all(0 <= r.score <= 1 for r in out.tokens)
        query = make_policy("query-classifier", path=str(root / "query.pt"), share=0.5)
        for out in svc.generate_batch(prompts * 2, policy=query, max_tokens=6, ignore_eos=True):
            assert len({r.model for r in out.tokens}) == 1


def test_calibrate_cli_writes_a_policy_block_that_hits_its_share(trained, tmp_path):
    root, prompts, _, mp = trained
    from tokenrouter.training import calibrate

    results = calibrate.main([*LABELS, "--prompts", str(prompts), "--policy", "entropy", "--policy",
                              "query-confidence", "--share", "0.4", "--write", str(tmp_path)])
    entropy = results["entropy"]
    assert entropy["held_out"]["share"] == pytest.approx(0.4, abs=0.15)  # 6 held-out prompts
    block = yaml.safe_load((tmp_path / "entropy.yaml").read_text())["policy"]
    policy = make_policy(block["name"], **block["params"])
    assert policy.threshold == pytest.approx(entropy["score_threshold"])
    confidence = yaml.safe_load((tmp_path / "query-confidence.yaml").read_text())["policy"]
    assert make_policy(confidence["name"], **confidence["params"]).threshold == pytest.approx(
        results["query-confidence"]["score_threshold"])


def test_router_calibrated_to_a_recall_from_the_python_api(trained, tmp_path):
    root, prompts, first, _ = trained
    from tokenrouter.config import load_config
    from tokenrouter.training.dataset import Pair, make_labels, read_prompts, split
    from tokenrouter.training.labels import LabelSpec
    from tokenrouter.training.train import calibrate_router, data_stats, router_scores, save_trained, train_router

    spec = LabelSpec(max_tokens=16, continuation=4, min_overlap=0.25, query_match=0.05, group=8)
    pair = Pair(load_config(PAIR))
    done = []
    groups = make_labels(pair, read_prompts(prompts), spec, log=lambda _: None, progress=done.append)
    assert done == [8, 8, 8]
    data = split(groups, spec, (0.25, 0.25), seed=0)
    net, history = train_router("probe", data, epochs=2)
    calibrated = calibrate_router(net, "probe", data, target_recall=0.8)
    assert calibrated["target"] == {"recall": 0.8}
    assert calibrated["calibration"]["recall"] >= 0.8
    scores, labels = router_scores(net, "probe", data["calibrate"])
    sent = scores > calibrated["threshold"]
    assert int((sent & labels.bool()).sum()) == round(calibrated["calibration"]["recall"] * labels.sum().item())
    with pytest.raises(ValueError, match="target_share, target_recall"):
        calibrate_router(net, "probe", data, target_share=0.2, target_recall=0.8)
    meta = save_trained(tmp_path / "probe.pt", net, "probe", calibrated, history, pair, PAIR,
                        data_stats(data, spec), "a test")
    policy = make_policy("probe", path=str(tmp_path / "probe.pt"))
    assert policy.threshold == pytest.approx(calibrated["threshold"])
    assert meta["data"]["prompts"] == first["probe"]["data"]["prompts"]
