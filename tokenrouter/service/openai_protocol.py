"""OpenAI-compatible request models and the JSON the HTTP server answers with. Routing options travel in
the extra body field `routing`; every response and stream chunk renders the engine's TokenRecords as
`provenance`, and usage is split per model."""
from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import asdict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenrouter.engine.sequence import TokenRecord
from tokenrouter.service.output import RequestMetrics, RoutedOutput

SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos")
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 4, 256, 64


class RoutingOptions(BaseModel):
    """`{"policy": "confidence", "threshold": 0.8}` or `{"policy": "confidence:threshold=0.8"}`; keys other
    than `policy` are the policy's parameters. No policy: the server config's default."""
    model_config = ConfigDict(extra="allow")
    policy: str | None = None

    def params(self) -> dict[str, Any]:
        extra = dict(self.model_extra or {})
        misplaced = sorted(set(extra) & set(SAMPLING))
        if misplaced:
            raise ValueError(f"routing.{misplaced[0]}: sampling options go at the top level of the request")
        return extra


class StreamOptions(BaseModel):
    include_usage: bool = True  # accepted for compatibility: the last chunk always carries usage


class GenerationRequest(BaseModel):
    """Fields both endpoints share. Unknown fields are errors naming the field."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    routing: RoutingOptions = Field(default_factory=RoutingOptions)
    request_timeout: float | None = Field(default=None, gt=0)  # seconds; the server's default when absent

    def sampling(self) -> dict[str, Any]:
        """The sampling options given (raises ValueError naming the field past the server's bounds)."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop: a stop string may have at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids or ()) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(self.stop_token_ids)}")
        return {k: v for k in SAMPLING if (v := getattr(self, k)) is not None}


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]  # a string is sent as is (no chat template); a list is token ids


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def sampling(self) -> dict[str, Any]:
        out = super().sampling()
        if self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        return out


# ---- responses -------------------------------------------------------------------------------------
def record_json(r: TokenRecord) -> dict:
    return {**asdict(r), "score": finite(r.score)}


def finite(x: float) -> float | None:
    """JSON has no NaN: a value no router or clock produced is null."""
    return None if x is None or math.isnan(x) else x


def usage_json(prompt_tokens: int, records: list[TokenRecord], models: list[str]) -> dict:
    per_model = dict.fromkeys(models, 0)
    for r in records:
        per_model[r.model] += 1
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(records),
            "total_tokens": prompt_tokens + len(records), "completion_tokens_per_model": per_model}


def routing_json(out: RoutedOutput) -> dict:
    m = out.metrics
    return {"policy": out.policy, "models": out.models, "handoffs": m.handoffs, "large_share": m.large_share,
            "tokens_computed": m.tokens_computed, "discarded_tokens": m.discarded_tokens, "ttft": finite(m.ttft),
            "tpot": finite(m.tpot), "e2e": m.e2e, "drafted": m.drafted, "accepted": m.accepted,
            "acceptance_rate": finite(m.acceptance_rate)}


class ResponseIds:
    """The id, creation time and served model name one response's body and chunks share."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def _envelope(self, kind: str, choice: dict) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def response(self, out: RoutedOutput) -> dict:
        choice = {"index": 0, "finish_reason": out.finish_reason, "logprobs": None,
                  "provenance": [record_json(r) for r in out.tokens]}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        body = self._envelope("chat.completion" if self.chat else "text_completion", choice)
        return {**body, "usage": usage_json(out.prompt_tokens, out.tokens, out.models), "routing": routing_json(out)}

    def chunk(self, text: str, records: list[TokenRecord], first: bool = False,
              final: RoutedOutput | None = None) -> dict:
        choice = {"index": 0, "finish_reason": final.finish_reason if final else None, "logprobs": None,
                  "provenance": [record_json(r) for r in records]}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", choice)
        if final is not None:
            body["usage"] = usage_json(final.prompt_tokens, final.tokens, final.models)
            body["routing"] = routing_json(final)
        return body


# status -> (error type, default code); codes are strings, as OpenAI's are
ERRORS = {400: ("invalid_request_error", "invalid_request"), 401: ("authentication_error", "invalid_api_key"),
          404: ("not_found_error", "not_found"), 405: ("invalid_request_error", "method_not_allowed"),
          413: ("invalid_request_error", "request_too_large"), 499: ("invalid_request_error", "client_closed_request"),
          500: ("server_error", "internal_error"), 503: ("service_unavailable", "engine_failed"),
          504: ("timeout", "request_timeout")}
OVERLOADED = "engine_overloaded"  # the other 503 code: the engine is healthy but full (retry later)


# an absolute path in a message: at its start or after a space, quote, bracket, "=" or ","
SERVER_PATH = re.compile(r"(?:(?<=^)|(?<=[\s'\"(\[=,]))/[^\s'\"()\[\],;]+")


def redact_paths(message: str) -> str:
    """`message` without the server's file paths (a router checkpoint, a model directory, a config): what a
    client is told about the server's own files is that they exist, never where."""
    return SERVER_PATH.sub("<server file>", message)


def error_json(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}` for an HTTP status (and an optional specific code)."""
    kind, default = ERRORS.get(status, ("invalid_request_error" if status < 500 else "server_error", "error"))
    return {"error": {"message": message, "type": kind, "param": param, "code": code or default}}


def error_status(code: str) -> int:
    """The HTTP status of an error code (what a stream's error event carries)."""
    if code == OVERLOADED:
        return 503
    return next((status for status, (_, c) in ERRORS.items() if c == code), 500)


# ---- reading responses back (the client) -----------------------------------------------------------
def parse_record(r: dict) -> TokenRecord:
    return TokenRecord(r["token_id"], r["text"], r["model"], math.nan if r["score"] is None else r["score"], r["t"],
                       r.get("verified", False), r.get("correction", False), r.get("tolerated", False))


def routed_output(text: str, records: list[TokenRecord], finish_reason: str, usage: dict,
                  routing: dict) -> RoutedOutput:
    """A RoutedOutput from a response's (or a stream's final chunk's) usage and routing objects; the metrics
    are the server's (token times are seconds since the request reached the engine)."""
    models = routing["models"]
    metrics = RequestMetrics.from_records(records, models, routing["handoffs"], routing["tokens_computed"],
                                          routing["e2e"], routing.get("discarded_tokens", 0),
                                          routing.get("drafted", 0), routing.get("accepted", 0))
    return RoutedOutput(text, records, finish_reason, usage["prompt_tokens"], routing["policy"], models, metrics)
