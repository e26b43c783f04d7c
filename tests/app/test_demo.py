"""The terminal demo (`python -m tokenrouter.demo`): the app's defaults, every option described in --help, an
answer cut at --max-tokens says so, and bad arguments end it before any model loads."""
from __future__ import annotations

import pytest

from app.__main__ import main as app_main
from app.controls import DEFAULT_MAX_TOKENS
from tests.app.conftest import PAIR
from tokenrouter import demo
from tokenrouter.config import DEFAULT_CONFIG, load_config


def test_the_demo_starts_where_the_app_starts():
    args = demo.parser().parse_args([])
    assert args.max_tokens == DEFAULT_MAX_TOKENS >= 313  # the longest held-out answer (tokenrouter/demo.py)
    assert args.config == DEFAULT_CONFIG
    assert {m.dtype for m in load_config(DEFAULT_CONFIG).models} == {"auto"}  # issue 25: a default that fits in 8 GB


def test_help_describes_every_option():
    for action in demo.parser()._actions:
        assert action.help and len(action.help) > 10, action.dest


def test_the_app_help_describes_every_option(capsys):
    with pytest.raises(SystemExit):
        app_main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    for option in ("--config", "--server", "--policy", "--host", "--port"):
        line = next(line for line in lines if line.startswith(f"  {option} "))
        assert len(line.split(maxsplit=2)) == 3, line  # option, metavar, description


def test_an_answer_cut_at_max_tokens_says_so(capsys):
    demo.main(["--config", PAIR, "--policy", "schedule:every=2", "--max-tokens", "6", "Count to ten."])
    out = capsys.readouterr().out
    assert "[6 tokens (small 3, large 3); large share 50%; hand-offs 3;" in out
    assert "finish length; cut at --max-tokens 6]" in out


@pytest.mark.parametrize("argv, message", [(["--max-tokens", "0"], "--max-tokens"),
                                           (["--policy", "no-such"], "--policy"),
                                           (["--config", "nowhere.yaml"], "--config")])
def test_bad_arguments_end_before_any_model_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        demo.main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err
