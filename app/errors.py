"""Failures shown as messages in the UI, never as stack traces: engine busy, bad input, a lost server."""
from __future__ import annotations

import logging

import httpx

from tokenrouter.engine.runtime import EngineFailed, EngineOverloaded

log = logging.getLogger("app")


def user_message(error: BaseException) -> str:
    """One line saying what went wrong and what to do; unexpected errors are logged with their traceback."""
    if isinstance(error, EngineOverloaded) or _status(error) == 503:
        return f"Engine busy: {_detail(error)}. Try again in a moment."
    if isinstance(error, EngineFailed):
        return f"Engine failed: {_detail(error)}. Restart it."
    if isinstance(error, TimeoutError):
        return f"Timed out: {_detail(error)}"
    if isinstance(error, ValueError):
        return f"Bad input: {_detail(error)}"
    if isinstance(error, (httpx.TransportError, ConnectionError)):
        return f"Lost the server: {_detail(error)}. Is it still running?"
    log.error("request failed", exc_info=error)
    return f"Request failed: {type(error).__name__}: {_detail(error)}"


def _status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    return getattr(error, "status_code", None) or getattr(response, "status_code", None)


def _detail(error: BaseException) -> str:
    return str(error) or type(error).__name__
