"""Multi-turn agentic workload: code-editing sessions on one Python file, where every turn asks for an edit
and every reply carries the whole updated file, so the context accumulates turn by turn.

Scripted sessions replay fixed assistant replies (the correctly edited file), so each turn's request is
known in advance and deterministic given the seed; live sessions feed the model's own replies back."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from tokenrouter.bench.workloads import Request

SYSTEM = ("You are a coding assistant editing one Python file. Always reply with the whole updated file "
          "in a ```python block.")
FUNCTIONS = {
    "clamp": ("limit a value to the range [low, high]",
              "def clamp(value, low, high):\n    return max(low, min(high, value))"),
    "mean": ("return the arithmetic mean of a non-empty list",
             "def mean(values):\n    return sum(values) / len(values)"),
    "slugify": ("turn a title into a lower-case, dash-separated slug",
                "def slugify(title):\n    words = title.lower().split()\n    return '-'.join(words)"),
    "chunks": ("split a list into pieces of a given size",
               "def chunks(items, size):\n    return [items[i:i + size] for i in range(0, len(items), size)]"),
    "is_even": ("tell whether an integer is even", "def is_even(n):\n    return n % 2 == 0"),
    "word_count": ("count the words in a text", "def word_count(text):\n    return len(text.split())"),
    "flatten": ("flatten a list of lists one level",
                "def flatten(rows):\n    return [x for row in rows for x in row]"),
    "median": ("return the median of a non-empty list",
               "def median(values):\n    s = sorted(values)\n    mid = len(s) // 2\n"
               "    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2"),
    "invert": ("swap the keys and values of a dict",
               "def invert(mapping):\n    return {v: k for k, v in mapping.items()}"),
    "retry": ("call a function up to n times until it does not raise",
              "def retry(fn, n):\n    for attempt in range(n):\n        try:\n            return fn()\n"
              "        except Exception:\n            if attempt == n - 1:\n                raise"),
}
SUFFIXES = ("_safe", "_v2", "_fast", "_value", "_items")


@dataclass(slots=True)
class Session:
    session_id: str
    filename: str
    user_turns: list[str]
    scripted_replies: list[str]
    max_tokens: int
    replies: list[str] = field(default_factory=list)  # the model's replies so far (live sessions)

    def messages(self, turn: int, replies: list[str] | None = None) -> list[dict]:
        """The conversation up to user turn `turn`, with `replies` (default: the scripted ones) as the
        assistant's earlier answers."""
        replies = self.scripted_replies if replies is None else replies
        out = [{"role": "system", "content": SYSTEM}]
        for t in range(turn + 1):
            out.append({"role": "user", "content": self.user_turns[t]})
            if t < turn:
                out.append({"role": "assistant", "content": replies[t]})
        return out


def coding_sessions(n: int, turns: int = 6, seed: int = 0, max_tokens: int = 512,
                    start_functions: int = 4) -> list[Session]:
    """`n` editing sessions of `turns` turns each on a file of `start_functions` functions."""
    if n < 1 or turns < 1:
        raise ValueError(f"n and turns: must be >= 1, got n={n}, turns={turns}")
    if not 1 <= start_functions <= len(FUNCTIONS) - 1:
        raise ValueError(f"start_functions: must be in [1, {len(FUNCTIONS) - 1}], got {start_functions}")
    rng = random.Random(seed)
    return [_session(rng, f"session-{seed}-{i}", turns, max_tokens, start_functions) for i in range(n)]


def _session(rng: random.Random, session_id: str, turns: int, max_tokens: int, start: int) -> Session:
    code = {name: FUNCTIONS[name][1] for name in rng.sample(sorted(FUNCTIONS), start)}
    filename = rng.choice(("utils.py", "helpers.py", "tools.py"))
    user_turns, replies = [], []
    for t in range(turns):
        before = _render(code)
        instruction = _edit(rng, code)
        if t == 0:
            instruction = f"Here is `{filename}`:\n\n```python\n{before}\n```\n\n{instruction}"
        user_turns.append(instruction)
        replies.append(f"Here is the updated `{filename}`:\n\n```python\n{_render(code)}\n```")
    return Session(session_id, filename, user_turns, replies, max_tokens)


def _edit(rng: random.Random, code: dict[str, str]) -> str:
    """Apply one random edit to `code` (function name -> source) in place; returns its instruction."""
    missing = [n for n in sorted(FUNCTIONS) if n not in code]
    kinds = ["add"] * 3 * bool(missing) + ["rename", "docstring"] + ["remove"] * (len(code) > 2)  # mostly growing
    kind, name = rng.choice(kinds), rng.choice(sorted(code))
    if kind == "add":
        new = rng.choice(missing)
        code[new] = FUNCTIONS[new][1]
        return f"Add a function `{new}` that should {FUNCTIONS[new][0]}."
    if kind == "rename":
        new = name + rng.choice(SUFFIXES)
        if new not in code:
            code[new] = code.pop(name).replace(f"def {name}(", f"def {new}(", 1)
            return f"Rename the function `{name}` to `{new}`."
    if kind == "remove":
        del code[name]
        return f"Delete the function `{name}`; nothing uses it any more."
    head, _, body = code[name].partition("\n")
    if '"""' not in body:
        purpose = _purpose(name)
        code[name] = f'{head}\n    """{purpose[0].upper()}{purpose[1:]}."""\n{body}'
    return f"Add a one-line docstring to `{name}`."


def _purpose(name: str) -> str:
    """What a function does, from the pool (a renamed function keeps its original's purpose)."""
    return next(FUNCTIONS[base][0] for base in sorted(FUNCTIONS, key=len, reverse=True) if name.startswith(base))


def _render(code: dict[str, str]) -> str:
    return "\n\n\n".join(code.values())


def scripted_requests(sessions: list[Session]) -> list[Request]:
    """Every turn of every session with the scripted history, turn by turn (all first turns, then all
    second turns, ...), so context grows over the run as it would in live sessions."""
    turns = max(len(s.user_turns) for s in sessions)
    return [Request(s.messages(t), s.max_tokens, "agentic", f"{s.session_id}-turn-{t}")
            for t in range(turns) for s in sessions if t < len(s.user_turns)]


def run_live(service, sessions: list[Session], concurrency: int = 8, **generate_args) -> list[list]:
    """Run the sessions against the engine, each turn seeing the model's own earlier replies; all sessions'
    turn t run as one batch. Returns, per session, its RoutedOutputs turn by turn."""
    outputs: list[list] = [[] for _ in sessions]
    for t in range(max(len(s.user_turns) for s in sessions)):
        active = [i for i, s in enumerate(sessions) if t < len(s.user_turns)]
        batch = [{"prompt": sessions[i].messages(t, sessions[i].replies), "max_tokens": sessions[i].max_tokens}
                 for i in active]
        for i, out in zip(active, service.generate_batch(batch, concurrency=concurrency, **generate_args)):
            sessions[i].replies.append(out.text)
            outputs[i].append(out)
    return outputs
