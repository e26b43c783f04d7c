"""Request bodies parsed within bounds, meant to run on a worker thread (never the engine's event loop): JSON,
then checks of sizes that cost next to nothing (keys, list lengths, messages, prompt characters against the
context), then pydantic on a body already known to be small, stopping at a list's first bad item. A body
under the size limit used to build one validation error per item of a 1.3-million-item `stop` list (23 s)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from tokenrouter.service.openai_protocol import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

MAX_VALUES = 1024  # JSON values in all the fields but `prompt` and `messages` together
MAX_DEPTH = 16
MIN_CHARS_PER_TOKEN = 16  # the character bound per token is the longest vocabulary entry, at least this
LIST_LIMITS = {"stop": MAX_STOP_STRINGS, "stop_token_ids": MAX_STOP_TOKEN_IDS}
TYPE_TAG = re.compile(r"(str|int|float|bool|(list|dict|tuple)\[.*\])")  # a union member's tag in a location


class BadBody(ValueError):
    """A 400 about `param` (the message starts with it)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True, slots=True)
class Bounds:
    context_limit: int  # tokens one sequence may hold, prompt and output
    chars_per_token: int  # the most characters one token can stand for

    @classmethod
    def of(cls, context_limit: int, tokenizer) -> Bounds:
        """`chars_per_token` from the tokenizer's longest vocabulary entry. NOTE: a byte-level entry has one
        character per byte and a character is at least one byte, so no text of n characters fits in fewer than
        n / longest tokens; other vocabularies only make the bound looser."""
        longest = max(map(len, tokenizer.get_vocab()), default=1)
        return cls(context_limit, max(longest, MIN_CHARS_PER_TOKEN))

    @property
    def max_prompt_chars(self) -> int:
        return self.context_limit * self.chars_per_token


def parse_body(raw: bytes, model: type[BaseModel], bounds: Bounds) -> BaseModel:
    """The request `model` from JSON bytes, or BadBody naming the field."""
    if not raw.strip():
        raise BadBody("body", "missing; send a JSON object")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadBody("body", f"malformed JSON ({e.msg} at character {e.pos})") from None
    except UnicodeDecodeError:
        raise BadBody("body", "malformed JSON (not UTF-8)") from None
    except RecursionError:
        raise BadBody("body", "malformed JSON (nested too deeply)") from None
    check_bounds(data, model, bounds)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BadBody(*first_error(e)) from None


def check_bounds(data, model: type[BaseModel], bounds: Bounds) -> None:
    """BadBody for a body too large to be worth validating: unknown keys (the first named), lists over their
    limit, more JSON values than any valid request has, or a prompt longer in characters than the context
    could hold in tokens. Anything it lets through is at most a few thousand values (plus prompt and messages)."""
    if not isinstance(data, dict):
        return  # pydantic says what it should be, in one error
    unknown = next((k for k in data if k not in model.model_fields), None)
    if unknown is not None:
        raise BadBody(unknown[:100].encode("utf-8", "backslashreplace").decode(), "Extra inputs are not permitted")
    budget = MAX_VALUES
    for key, value in data.items():
        if key == "prompt":
            check_prompt(value, bounds)
        elif key == "messages":
            check_messages(value, bounds)
        else:
            limit = LIST_LIMITS.get(key)
            if limit is not None and isinstance(value, list) and len(value) > limit:
                raise BadBody(key, f"at most {limit} items, got {len(value)}")
            budget = count_values(key, value, budget)


def check_prompt(prompt, bounds: Bounds) -> None:
    limit = bounds.context_limit
    if isinstance(prompt, str) and len(prompt) > bounds.max_prompt_chars:
        raise BadBody("prompt", f"{len(prompt)} characters; this engine's models hold {limit} tokens in all, and "
                      f"one token stands for at most {bounds.chars_per_token} characters, so at most "
                      f"{bounds.max_prompt_chars} characters can fit ({len(prompt) - bounds.max_prompt_chars} over)")
    if isinstance(prompt, list) and len(prompt) >= limit:
        raise BadBody("prompt", f"{len(prompt)} token ids, {len(prompt) - limit + 1} too many: this engine's models "
                      f"hold {limit} tokens in all, prompt and output")


def check_messages(messages, bounds: Bounds) -> None:
    """At most one message per token of context, each a small object, their content within the character
    bound together."""
    if not isinstance(messages, list):
        return
    limit = bounds.context_limit
    if len(messages) >= limit:
        raise BadBody("messages", f"{len(messages)} messages; this engine's models hold {limit} tokens in all, "
                      "and every message takes at least one")
    chars = 0
    for i, message in enumerate(messages):
        if isinstance(message, dict):
            if len(message) > 2:
                raise BadBody(f"messages.{i}", f"{len(message)} keys; a message has `role` and `content`")
            content = message.get("content")
            chars += len(content) if isinstance(content, str) else 0
    if chars > bounds.max_prompt_chars:
        raise BadBody("messages", f"{chars} characters of content; this engine's models hold {limit} tokens in all, "
                      f"and one token stands for at most {bounds.chars_per_token} characters, so at most "
                      f"{bounds.max_prompt_chars} characters can fit ({chars - bounds.max_prompt_chars} over)")


def count_values(key: str, value, budget: int) -> int:
    """`budget` less the JSON values in `value` (BadBody once it runs out or nesting passes MAX_DEPTH)."""
    todo = [(value, 1)]
    while todo:
        value, depth = todo.pop()
        budget -= 1
        if budget < 0:
            raise BadBody(key, f"the body holds more than {MAX_VALUES} values outside `prompt` and `messages`")
        if depth > MAX_DEPTH:
            raise BadBody(key, f"nested deeper than {MAX_DEPTH}")
        if isinstance(value, dict):
            todo.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            todo.extend((v, depth + 1) for v in value)
    return budget


def first_error(error: ValidationError) -> tuple[str, str]:
    """(param, message) of the validation error that got furthest into the body (see `field_error`)."""
    return field_error(error.errors(include_url=False, include_input=False))


def field_error(errors: list[dict]) -> tuple[str, str]:
    """The field and message of the validation error that got furthest into the body: for a union (`prompt`,
    a string or token ids) each member adds an error, under a tag that is no field name."""
    def field(e: dict) -> list[str]:
        return [str(p) for p in e["loc"] if p != "body" and not (isinstance(p, str) and TYPE_TAG.fullmatch(p))]

    error = max(errors, key=lambda e: len(field(e)))
    param = ".".join(field(error)) or "body"
    return param, error["msg"]
