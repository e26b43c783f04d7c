"""Failures as one-line messages: engine busy (in-process or HTTP 503), bad input, a lost server, and
anything else with its type (its traceback goes to the log, not the UI)."""
from __future__ import annotations

import logging

import httpx
import pytest

from app.errors import user_message
from tokenrouter.engine.runtime import EngineFailed, EngineOverloaded

REQUEST = httpx.Request("POST", "http://127.0.0.1:1/v1/chat/completions")


@pytest.mark.parametrize("error, start, detail", [
    (EngineOverloaded("engine overloaded: 256 requests in flight"), "Engine busy", "256 requests"),
    (httpx.HTTPStatusError("busy", request=REQUEST, response=httpx.Response(503)), "Engine busy", "busy"),
    (ValueError("max_tokens: must be >= 1, got 0"), "Bad input", "max_tokens"),
    (httpx.ConnectError("All connection attempts failed"), "Lost the server", "connection attempts"),
    (httpx.ReadTimeout("timed out"), "Lost the server", "timed out"),
    (ConnectionResetError(), "Lost the server", "ConnectionResetError"),
    (EngineFailed("engine failed: large: RuntimeError: boom"), "Engine failed", "boom"),
    (TimeoutError("request_timeout: 2 s passed"), "Timed out", "request_timeout"),
])
def test_known_failures_read_as_messages(error, start, detail):
    message = user_message(error)
    assert message.startswith(start) and detail in message


def test_unexpected_failures_name_their_type_and_log_the_traceback(caplog):
    with caplog.at_level(logging.ERROR, logger="app"):
        try:
            raise KeyError("choices")
        except KeyError as e:
            message = user_message(e)
    assert message == "Request failed: KeyError: 'choices'"
    assert caplog.records[0].exc_info is not None
