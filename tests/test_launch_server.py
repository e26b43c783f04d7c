"""`python -m tokenrouter.launch_server`: where the API key comes from, and no unauthenticated server on a
non-loopback address (refused before any model loads)."""
from __future__ import annotations

import pytest

import tokenrouter
from tokenrouter.launch_server import API_KEY_ENV, api_key, main, parse_args

PAIR = "config/tiny/pair.yaml"


def key_of(argv: list[str]) -> str | None:
    return api_key(parse_args(["--config_path", PAIR, *argv]))


def test_the_key_comes_from_a_file_the_environment_or_the_command_line(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert key_of([]) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert key_of([]) == "from-env"
    path = tmp_path / "key"
    path.write_text("from-file\n")
    assert key_of(["--api-key-file", str(path)]) == "from-file"
    assert key_of(["--api-key", "from-argv"]) == "from-argv"  # still accepted; visible in ps
    with pytest.raises(SystemExit):
        parse_args(["--config_path", PAIR, "--api-key", "a", "--api-key-file", str(path)])


@pytest.mark.parametrize("content", [None, ""])
def test_a_missing_or_empty_key_file_is_an_error(tmp_path, content):
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match="--api-key-file"):
        key_of(["--api-key-file", str(path)])


def test_a_non_loopback_host_without_a_key_refuses_to_start(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)

    def never(*args, **kwargs):
        raise AssertionError("models loaded")

    monkeypatch.setattr(tokenrouter, "serve", never)
    with pytest.raises(SystemExit, match="--allow-unauthenticated"):
        main(["--config_path", PAIR, "--host", "0.0.0.0", "--port", "0"])
    with pytest.raises(AssertionError, match="models loaded"):  # past the check: a key is set
        main(["--config_path", PAIR, "--host", "0.0.0.0", "--port", "0", "--api-key", "k"])
    with pytest.raises(AssertionError, match="models loaded"):
        main(["--config_path", PAIR, "--host", "0.0.0.0", "--port", "0", "--allow-unauthenticated"])
