"""Arguments checked before any model work (`tokenrouter/bench/checks.py`, used by every bench command and
by router training and calibration): a bad one exits at once with one message naming it (status 2), and
no model is ever loaded, which the tests see by making the model loader record and refuse every call."""
from __future__ import annotations

import argparse
import json

import pytest

from tokenrouter.bench import checks
from tokenrouter.bench.__main__ import COMMANDS
from tokenrouter.bench.__main__ import main as bench
from tokenrouter.engine.model_runner import ModelRunner
from tokenrouter.training import calibrate, train

PAIR = "config/tiny/pair.yaml"


@pytest.fixture
def loads(monkeypatch) -> list:
    """Every model load the command tries (each is refused, so nothing past the checks can run)."""
    seen = []

    def refuse(self, spec, *args, **kwargs):
        seen.append(spec.name)
        raise AssertionError(f"model {spec.name!r} loaded before the arguments were checked")

    monkeypatch.setattr(ModelRunner, "__init__", refuse)
    return seen


BAD = [
    (bench, ["quality", "--config", PAIR, "--policies", "all-small,all-large,confidence:1.5"],
     "--policies: 'confidence:1.5': threshold: must be in [0, 1]"),
    (bench, ["quality", "--config", PAIR, "--policies", "all-small,confidence:threshold"], "--policies: 'confidence:threshold'"),
    (bench, ["quality", "--config", "config/tiny/nope.yaml"], "--config: config/tiny/nope.yaml: config file not found"),
    (bench, ["quality", "--config", PAIR, "--tasks", "nope.jsonl"], "tasks: file not found: nope.jsonl"),
    (bench, ["quality", "--config", PAIR, "--concurrency", "0"], "--concurrency: must be >= 1"),
    (bench, ["pilot", "--config", PAIR, "--token-policies", "query-random:0.2"],
     "--token-policies: 'query-random:0.2' is a query-level policy, expected token-level"),
    (bench, ["pilot", "--config", PAIR, "--query-policies", "query-random:{shares}"], "--query-policies: 'query-random:{shares}'"),
    (bench, ["serve", "--config", PAIR, "--policy", "random:share=2"], "--policy: 'random:share=2': share: must be in [0, 1]"),
    (bench, ["serve", "--config", PAIR, "--baselines", "lockstep,magic"], "--baselines: unknown ['magic']"),
    (bench, ["serve"], "--config, --url: give one of them"),
    (bench, ["serve", "--url", "http://127.0.0.1:9", "--request-rate", "0"], "--request-rate: must be > 0"),
    (bench, ["serve", "--url", "http://127.0.0.1:9", "--step-trace", "s.json"], "--step-trace: the steps of a server"),
    (bench, ["sweep", "--config", PAIR, "--tau-ms", "0,soon"], "--tau-ms: expected milliseconds or 'auto'"),
    (bench, ["sweep", "--config", PAIR, "--concurrency", "4,x"], "--concurrency: expected comma-separated integers"),
    (bench, ["runner", "--config", PAIR, "--models", "huge"], "--models: 'huge' is not a model of"),
    (bench, ["runner", "--config", PAIR, "--prefill", "64,0"], "--prefill: expected integers >= 1"),
    (bench, ["runner", "--config", PAIR, "--prefill", "2000"], "--prefill: 2000 tokens is more than small's max_model_len"),
    (bench, ["runner", "--config", "config/gpu-check/qwen3-0.6b_8b-shapes.yaml", "--prefill", "64"],
     "--prefill: times CPU models; small runs on cuda"),
    (bench, ["acceptance", "--config", PAIR, "--temperatures", "0,hot"], "--temperatures: expected comma-separated numbers"),
    (bench, ["acceptance", "--config", "config/tiny/llama.yaml"], "acceptance needs a drafter and a verifier"),
    (train.main, ["--config", PAIR, "--kind", "probe", "--prompts", "nope.jsonl"], "--prompts:"),
    (train.main, ["--config", PAIR, "--kind", "neural,bogus"], "--kind: kind: must be one of"),
    (train.main, ["--config", PAIR, "--kind", "probe", "--target-share", "1.5"], "--target-share: must be in [0, 1]"),
    (calibrate.main, ["--config", PAIR, "--policy", "entropy", "--policy", "confidence:high", "--share", "0.2"],
     "--policy: 'confidence:high'"),
    (calibrate.main, ["--config", PAIR, "--policy", "query-confidence", "--tasks", "nope.jsonl", "--share", "0.2"],
     "tasks: file not found"),
]


@pytest.mark.parametrize("command, argv, message", BAD, ids=[" ".join(argv[:1] + argv[-2:]) for _, argv, _ in BAD])
def test_a_bad_argument_exits_with_one_message_before_any_model_loads(command, argv, message, loads, capsys):
    with pytest.raises(SystemExit) as exit:
        command(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert loads == []


def test_a_task_file_the_harness_could_not_check_against_exits_before_any_model_loads(tmp_path, loads, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "t/1", "prompt": "def f():\n", "entry_point": "f",
                               "test": 'def check(c):\n    assert c() == "\ud800"\n'}) + "\n")
    with pytest.raises(SystemExit) as exit:
        bench(["quality", "--config", PAIR, "--tasks", str(bad)])
    assert exit.value.code == 2
    assert "--tasks: bad.jsonl line 1: task 't/1': field 'test' is not encodable as UTF-8" in capsys.readouterr().err
    assert loads == []


def parsed(command: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    COMMANDS[command].add_arguments(parser)
    return parser.parse_args(argv)


def test_good_arguments_pass_the_checks_with_the_shorthand(loads):
    COMMANDS["quality"].check_args(parsed("quality", ["--config", PAIR, "--policies",
                                                      "all-small,confidence:0.9,random:0.15,seed=2"]))
    COMMANDS["pilot"].check_args(parsed("pilot", ["--config", PAIR, "--token-policies", "entropy:2.0",
                                                  "--query-policies", "query-random:{share},seed=1"]))
    COMMANDS["serve"].check_args(parsed("serve", ["--config", PAIR, "--policy", "random:0.15"]))
    assert loads == []


def test_levels_and_bounds_name_the_argument():
    assert checks.levels("1, 4,16") == [1, 4, 16]
    with pytest.raises(ValueError, match="^--batch: expected integers >= 1"):
        checks.levels("0,2", "--batch")
    with pytest.raises(ValueError, match="^--share: must be in"):
        checks.fraction(-0.1, "--share")
