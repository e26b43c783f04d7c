"""OpenAI-compatible request models and the JSON the HTTP server answers with. Routing options travel in
the extra body field `routing`; every response and stream chunk renders the engine's TokenRecords as
`provenance`, and usage is split per model. Requests are typed strictly (JSON true is not 1, "5" is not 5)."""
from __future__ import annotations

import inspect
import json
import math
import re
import time
import uuid
from dataclasses import asdict
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, FailFast, Field

from tokenrouter.engine.sequence import TokenRecord
from tokenrouter.policies import POLICIES
from tokenrouter.service.output import RequestMetrics, RoutedOutput

SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos")
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 4, 256, 64
STRICT = ConfigDict(extra="forbid", strict=True)


class FirstError(FailFast):
    """A list's validation stops at its first bad item (hashable, so a union can hold it)."""

    def __hash__(self) -> int:
        return hash(FailFast)


Ints, Strs = Annotated[list[int], FirstError()], Annotated[list[str], FirstError()]

# OpenAI parameters the engine does not implement: (the values that ask for nothing, why another cannot be
# honoured). The official client sends a parameter only when given, and null for one given as None.
NO_TOOLS = "this server calls no tools"
NO_LOGPROBS = "no log probabilities are returned (`provenance` carries each token's router score)"
NOT_IMPLEMENTED: dict[str, tuple[tuple, str]] = {
    "n": ((None, 1), "one choice per request"),
    "frequency_penalty": ((None, 0), "sampling applies no penalties"),
    "presence_penalty": ((None, 0), "sampling applies no penalties"),
    "logit_bias": ((None, {}), "sampling applies no logit bias"),
}
COMPLETION_NOT_IMPLEMENTED = NOT_IMPLEMENTED | {
    "best_of": ((None, 1), "one sequence per request"),
    "echo": ((None, False), "the prompt is not echoed"),
    "suffix": ((None, ""), "no insertion after a suffix"),
    "logprobs": ((None,), NO_LOGPROBS),
}
CHAT_NOT_IMPLEMENTED = NOT_IMPLEMENTED | {
    "logprobs": ((None, False), NO_LOGPROBS),
    "top_logprobs": ((None, 0), NO_LOGPROBS),
    "tools": ((None, []), NO_TOOLS),
    "tool_choice": ((None, "none", "auto"), NO_TOOLS),
    "functions": ((None, []), NO_TOOLS),
    "function_call": ((None, "none", "auto"), NO_TOOLS),
    "response_format": ((None, {"type": "text"}), "no structured output"),
    "modalities": ((None, ["text"]), "text output only"),
    "audio": ((None,), "text output only"),
    "prediction": ((None,), "no predicted outputs"),
    "reasoning_effort": ((None,), "the models take no reasoning effort"),
    "verbosity": ((None,), "the models take no verbosity"),
    "web_search_options": ((None,), "no web search"),
    "moderation": ((None,), "no moderation"),
    "service_tier": ((None, "auto", "default"), "one service tier"),
    "store": ((None, False), "nothing is stored"),
}


class RoutingOptions(BaseModel):
    """`{"policy": "confidence", "threshold": 0.8}` or `{"policy": "confidence:threshold=0.8"}`; keys other
    than `policy` are the policy's parameters. No policy: the server config's default."""
    model_config = ConfigDict(extra="allow", strict=True)
    policy: str | None = None

    def params(self, default_policy: str) -> dict[str, Any]:
        """The policy's parameters. A sampling option here is an error unless the policy takes a parameter of
        that name (the random policies' `seed`)."""
        extra = dict(self.model_extra or {})
        name = (self.policy or default_policy).partition(":")[0].strip()
        misplaced = sorted(k for k in set(extra) & set(SAMPLING) if not takes_parameter(name, k))
        if misplaced:
            raise ValueError(f"routing.{misplaced[0]}: sampling options go at the top level of the request")
        return extra


def takes_parameter(policy: str, key: str) -> bool:
    """Whether policy `policy` declares `key` or passes its extra parameters on (a wrapper's `**inner`)."""
    if policy not in POLICIES:
        return False
    params = inspect.signature(POLICIES[policy]).parameters
    return key in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = True  # accepted for compatibility: the last chunk always carries usage
    include_obfuscation: bool | None = None  # accepted; chunks are not padded


class GenerationRequest(BaseModel):
    """Fields both endpoints share. Unknown fields are errors naming the field, and so are values of the
    OpenAI parameters in `not_implemented` other than the ones that ask for nothing (`check`)."""
    model_config = STRICT
    not_implemented: ClassVar[dict] = NOT_IMPLEMENTED
    model: str | None = None
    max_tokens: int | None = None  # None: the engine's default, or what the context has left if less
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | Strs | None = None
    stop_token_ids: Ints | None = None
    ignore_eos: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    routing: RoutingOptions = Field(default_factory=RoutingOptions)
    request_timeout: float | None = Field(default=None, gt=0)  # seconds; the server's default when absent
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def check(self) -> None:
        """Raise ValueError naming the first field the engine cannot honour: a not-implemented parameter that
        asks for something, or text that is not Unicode."""
        for field, (neutral, why) in self.not_implemented.items():
            value = getattr(self, field)
            if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
                accepted = " or ".join(json.dumps(v) for v in neutral)
                raise ValueError(f"{field}: not supported: {why}; only {accepted} is accepted")
        for stop in [self.stop] if isinstance(self.stop, str) else self.stop or []:
            check_text("stop", stop)

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


def check_text(field: str, text: str) -> None:
    """A str from JSON may hold a lone surrogate (`"\\ud800"`), which no tokenizer can read: ValueError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field}: a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start} is not "
                         "text; send the character's UTF-8 or its whole surrogate pair") from None


class CompletionRequest(GenerationRequest):
    not_implemented: ClassVar[dict] = COMPLETION_NOT_IMPLEMENTED
    prompt: str | Ints  # a string is sent as is (no chat template); a list is token ids
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = None

    def check(self) -> None:
        super().check()
        if isinstance(self.prompt, str):
            check_text("prompt", self.prompt)


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(GenerationRequest):
    not_implemented: ClassVar[dict] = CHAT_NOT_IMPLEMENTED
    messages: Annotated[list[ChatMessage], FirstError()] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # accepted and ignored (no tools)
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)  # accepted and ignored
    prompt_cache_key: str | None = None  # accepted and ignored
    safety_identifier: str | None = None  # accepted and ignored

    def check(self) -> None:
        super().check()
        for i, message in enumerate(self.messages):
            check_text(f"messages.{i}.content", message.content)

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
