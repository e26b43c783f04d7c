"""Code-editing sessions: deterministic scripts, a growing context, valid files, and live turns on the engine."""
from __future__ import annotations

import ast
import re

import pytest

from tokenrouter.bench.sessions import coding_sessions, run_live, scripted_requests


def code_block(text: str) -> str:
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_sessions_are_deterministic_given_the_seed():
    a, b, c = coding_sessions(3, seed=4), coding_sessions(3, seed=4), coding_sessions(3, seed=5)
    assert [s.user_turns for s in a] == [s.user_turns for s in b]
    assert [s.scripted_replies for s in a] == [s.scripted_replies for s in b]
    assert [s.user_turns for s in a] != [s.user_turns for s in c]


def test_context_accumulates_turn_by_turn():
    for s in coding_sessions(4, turns=8, seed=2):
        sizes = [sum(len(m["content"]) for m in s.messages(t)) for t in range(8)]
        assert sizes == sorted(sizes) and sizes[-1] > 3 * sizes[0]
        roles = [m["role"] for m in s.messages(3)]
        assert roles == ["system"] + ["user", "assistant"] * 3 + ["user"]


def test_every_scripted_reply_is_a_valid_file_that_applies_its_edit():
    for s in coding_sessions(6, turns=8, seed=3):
        for instruction, reply in zip(s.user_turns, s.scripted_replies):
            defined = {n.name for n in ast.parse(code_block(reply)).body if isinstance(n, ast.FunctionDef)}
            named = re.findall(r"`(\w+)`", instruction.split("\n")[-1])
            if instruction.split("\n")[-1].startswith(("Add a function", "Add a one-line")):
                assert named[0] in defined
            elif "Rename" in instruction:
                assert named[1] in defined and named[0] not in defined
            elif "Delete" in instruction:
                assert named[0] not in defined


def test_scripted_requests_go_turn_by_turn():
    sessions = coding_sessions(3, turns=2, seed=1)
    requests = scripted_requests(sessions)
    assert [r.request_id for r in requests] == [f"session-1-{i}-turn-{t}" for t in range(2) for i in range(3)]
    assert requests[3].prompt == sessions[0].messages(1)


def test_bad_sizes_are_errors_naming_the_field():
    with pytest.raises(ValueError, match="turns"):
        coding_sessions(1, turns=0)
    with pytest.raises(ValueError, match="start_functions"):
        coding_sessions(1, start_functions=0)


def test_live_sessions_feed_the_models_replies_back(svc):
    sessions = coding_sessions(2, turns=2, seed=0, max_tokens=4, start_functions=1)
    outputs = run_live(svc, sessions, concurrency=2, policy="schedule:every=2")
    assert [len(o) for o in outputs] == [2, 2]
    for s, outs in zip(sessions, outputs):
        assert s.replies == [o.text for o in outs]
        assert s.messages(1, s.replies)[2] == {"role": "assistant", "content": outs[0].text}
        assert outs[1].prompt_tokens > outs[0].prompt_tokens
    scripted = svc.generate_batch([r.args() for r in scripted_requests(sessions)], concurrency=4, policy="all-small")
    assert all(not o.error and o.tokens for o in scripted)
