"""Workloads: determinism, checkable answers, caps, JSONL validation, and that the engine accepts them."""
from __future__ import annotations

import json
import re

import pytest

from tokenrouter.bench.word_problems import TEMPLATES
from tokenrouter.bench.workloads import final_number, is_correct, jsonl_prompts, long_generation, math_problems


def test_math_problems_are_deterministic_given_the_seed():
    assert [r.prompt for r in math_problems(16, seed=5)] == [r.prompt for r in math_problems(16, seed=5)]
    assert [r.prompt for r in math_problems(16, seed=5)] != [r.prompt for r in math_problems(16, seed=6)]
    assert len({r.request_id for r in math_problems(16)}) == 16


def numbers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def test_answers_agree_with_the_numbers_in_the_question():
    problems = math_problems(len(TEMPLATES) * 4, seed=11)
    for r in problems[0::len(TEMPLATES)]:  # shopping: a notebooks at pa, b pens at pb, paid
        a, pa, b, pb, paid = numbers(r.prompt.splitlines()[0])
        assert r.answer == paid - a * pa - b * pb > 0
    for r in problems[1::len(TEMPLATES)]:  # travel
        speed, hours, speed2, stop = numbers(r.prompt.splitlines()[0])
        assert r.answer == speed * hours + speed2 * stop
    for r in problems[5::len(TEMPLATES)]:  # sharing: an exact share
        boxes, per_box, eaten, friends = numbers(r.prompt.splitlines()[0])
        assert (boxes * per_box - eaten) % friends == 0 and r.answer == (boxes * per_box - eaten) // friends
    for r in problems[7::len(TEMPLATES)]:  # tiles: whole boxes, rounded up
        length, width, tile = numbers(r.prompt.splitlines()[0])
        assert r.answer * tile >= length * width > (r.answer - 1) * tile


@pytest.mark.parametrize("text,expected", [
    ("so 12 + 30 = 42\nAnswer: 42", 42), ("The answer is $1,234.50.", 1234.5), ("#### -3", -3),
    ("first 5 then 6", 6), ("Answer:\n7 apples, 8 pears", 7), ("no digits here", None),
])
def test_final_number(text, expected):
    assert final_number(text) == expected


def test_is_correct_checks_the_final_answer():
    r = math_problems(1, seed=2)[0]
    assert is_correct(f"Working... Answer: {r.answer}", r.answer)
    assert not is_correct(f"Answer: {r.answer + 1}", r.answer)
    assert not is_correct("I don't know", r.answer)


def test_long_generation_has_a_cap_and_can_ignore_eos():
    requests = long_generation(5, seed=1, max_tokens=300, ignore_eos=True)
    assert all(r.args()["max_tokens"] == 300 and r.args()["ignore_eos"] is True for r in requests)
    assert "ignore_eos" not in long_generation(1)[0].args()
    assert [r.prompt for r in long_generation(5, seed=1)] == [r.prompt for r in requests]
    with pytest.raises(ValueError, match="max_tokens"):
        long_generation(1, max_tokens=0)
    with pytest.raises(ValueError, match="n:"):
        math_problems(0)


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "id": "a"}) + "\n\n"
                    + json.dumps({"messages": [{"role": "user", "content": "yo"}], "max_tokens": 7}) + "\n")
    a, b = jsonl_prompts(path, max_tokens=20)
    assert a.args() == {"prompt": "hi", "max_tokens": 20} and a.request_id == "a"
    assert b.args() == {"prompt": [{"role": "user", "content": "yo"}], "max_tokens": 7} and b.request_id == "prompts-1"
    cases = [("{oops", "line 1: invalid JSON"), ('{"text": "x"}', "exactly one of the fields"),
             ('{"prompt": ""}', "field 'prompt'"), ('{"messages": [{"role": "user"}]}', "field 'messages'"),
             ('{"prompt": "x", "max_tokens": 0}', "field 'max_tokens'"), ("", "no requests")]
    for text, message in cases:
        path.write_text(text + "\n")
        with pytest.raises(ValueError, match=message):
            jsonl_prompts(path)


def test_the_engine_accepts_every_workload(svc, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    requests = [*math_problems(2, max_tokens=4), *long_generation(2, max_tokens=12, ignore_eos=True),
                *jsonl_prompts(path, max_tokens=3)]
    outs = svc.generate_batch([r.args() for r in requests], concurrency=4, policy="schedule:every=3")
    assert [o.error for o in outs] == [""] * len(requests)
    assert [len(o.tokens) for o in outs[2:4]] == [12, 12]  # ignore_eos runs every long request to its cap
    assert all(len(o.tokens) <= r.max_tokens for o, r in zip(outs, requests))
