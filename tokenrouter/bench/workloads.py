"""Workloads: lists of requests the Service accepts (`generate_batch([r.args() for r in requests])`),
deterministic given a seed. Short-input reasoning (math word problems with a checkable numeric answer),
long-output generation under a configurable cap, user-supplied JSONL prompts; multi-turn code-editing
sessions live in `tokenrouter.bench.sessions`."""
from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from tokenrouter.bench import read_jsonl
from tokenrouter.bench.word_problems import TEMPLATES

MATH_INSTRUCTION = ("Solve the problem. Think step by step, then give the final answer on its own line as "
                    "'Answer: <number>'.")
FORMS = ("tutorial", "technical design document", "short story", "detailed explanation", "code review")
TOPICS = ("building a key-value store in Python", "how TCP congestion control works", "writing a tokenizer",
          "profiling a slow web service", "the history of the Fortran language", "caching strategies for APIs",
          "a lighthouse keeper who learns to program", "designing a rate limiter", "garbage collection in CPython",
          "testing asynchronous code", "migrating a database schema without downtime", "how a CPU cache works")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass(slots=True)
class Request:
    prompt: str | list[dict]
    max_tokens: int
    kind: str
    request_id: str
    answer: float | None = None  # the expected number, for reasoning problems
    extra: dict = field(default_factory=dict)  # further generate() arguments (e.g. ignore_eos)

    def args(self) -> dict:
        """The request as generate() / generate_batch() arguments."""
        return {"prompt": self.prompt, "max_tokens": self.max_tokens, **self.extra}


def math_problems(n: int, seed: int = 0, max_tokens: int = 256) -> list[Request]:
    """Arithmetic word problems (shopping, rates, ages, percentages, ...) with their exact answers."""
    _check_count(n, max_tokens)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        question, answer = TEMPLATES[i % len(TEMPLATES)](rng)
        out.append(Request(f"{question}\n{MATH_INSTRUCTION}", max_tokens, "math", f"math-{seed}-{i}", answer))
    return out


def final_number(text: str) -> float | None:
    """The answer a response gives: the first number after its last 'Answer' (or '####'), else its last number."""
    parts = re.split(r"(?i)\banswer\b[^0-9\n-]{0,20}|####", text)
    after = NUMBER.findall(parts[-1]) if len(parts) > 1 else []
    numbers = after[:1] or NUMBER.findall(text)[-1:]
    return float(numbers[0].replace(",", "")) if numbers else None


def is_correct(text: str, answer: float, tolerance: float = 1e-6) -> bool:
    got = final_number(text)
    return got is not None and abs(got - answer) <= tolerance * max(1.0, abs(answer))


def long_generation(n: int, seed: int = 0, max_tokens: int = 1024, ignore_eos: bool = False) -> list[Request]:
    """Prompts that ask for long answers; `max_tokens` caps them (with `ignore_eos`, every one runs to it)."""
    _check_count(n, max_tokens)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        form, topic = rng.choice(FORMS), rng.choice(TOPICS)
        words = rng.choice((800, 1200, 2000))
        prompt = f"Write a {form} of about {words} words on {topic}. Use sections with headings and be thorough."
        extra = {"ignore_eos": True} if ignore_eos else {}
        out.append(Request(prompt, max_tokens, "long", f"long-{seed}-{i}", extra=extra))
    return out


def jsonl_prompts(path: str | Path, max_tokens: int = 256) -> list[Request]:
    """One request per line: {"prompt": "..."} or {"messages": [{"role", "content"}, ...]}, optional
    "max_tokens" and "id" (default: file stem and index). Raises ValueError naming the line and field."""
    out = []
    for where, row in read_jsonl(path, "prompts"):
        if ("prompt" in row) == ("messages" in row):
            raise ValueError(f"{where}: needs exactly one of the fields 'prompt' and 'messages'")
        prompt = row.get("prompt", row.get("messages"))
        if "prompt" in row and not (isinstance(prompt, str) and prompt):
            raise ValueError(f"{where}: field 'prompt' must be a non-empty string")
        if "messages" in row and not _messages_ok(prompt):
            raise ValueError(f"{where}: field 'messages' must be a non-empty list of {{'role', 'content'}} strings")
        limit = row.get("max_tokens", max_tokens)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"{where}: field 'max_tokens' must be an integer >= 1, got {limit!r}")
        out.append(Request(prompt, limit, "jsonl", str(row.get("id", f"{Path(path).stem}-{len(out)}"))))
    if not out:
        raise ValueError(f"prompts: no requests in {path}")
    return out


def _messages_ok(messages) -> bool:
    return isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)


def _check_count(n: int, max_tokens: int) -> None:
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
