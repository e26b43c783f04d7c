"""The task format, code extraction from responses, the program the sandbox runs, and the project's task set."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tokenrouter.bench.humaneval import PROJECT_TASKS, Task, extract_code, load_tasks, program, request
from tokenrouter.bench.quality import check
from tokenrouter.bench.sandbox import run_tests

ADD = Task("t/0", 'from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    """Sum."""\n', "add",
           "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n")
GOOD = "def add(xs: List[int]) -> int:\n    return sum(xs)\n"


def passes(task: Task, response: str) -> bool:
    return check(task, response).passed


@pytest.mark.parametrize("response", [
    f"Here you go:\n```python\n{GOOD}```\nIt sums the list.",
    f"```py\nimport math\n\n{GOOD}```",
    f"```\n{GOOD}```",
    f"First a helper:\n```python\ndef helper():\n    pass\n```\nThen:\n```python\n{GOOD}```",
    f"```python\n{GOOD}",  # cut off by max_tokens before the closing fence
    f"Sure! The function is:\n\n{GOOD}\nThis works for any list.",  # unfenced; the prose after it stays out
    "    return sum(xs)\n",  # a completion continuing the prompt
    "    return sum(xs)\n\nprint(add([5]))\nassert False\n",  # the completion ends at the first top-level line
])
def test_code_is_found_in_common_response_shapes(response):
    assert passes(ADD, response)


def test_a_wrong_or_empty_answer_fails():
    assert not passes(ADD, "```python\ndef add(xs):\n    return 0\n```")
    assert not passes(ADD, "I cannot help with that.")
    assert not passes(ADD, "```python\ndef add(xs):\n    import sys; sys.exit(0)\n```")


def test_the_prompt_imports_stay_available_to_a_full_definition():
    assert "from typing import List" in program(ADD, GOOD)
    assert "check" not in program(ADD, GOOD)  # the tests run in a process of their own


def test_requests_for_chat_and_completion():
    chat = request(ADD, "chat")
    assert ADD.prompt in chat["prompt"] and "```python" in chat["prompt"] and "raw" not in chat
    assert request(ADD, "completion") == {"prompt": ADD.prompt, "raw": True}
    with pytest.raises(ValueError, match="mode"):
        request(ADD, "poetry")


def write(tmp_path, rows) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_task_files_are_validated_naming_line_and_field(tmp_path):
    good = {"task_id": "a", "prompt": "def f():\n", "entry_point": "f", "test": "def check(c): pass"}
    two = write(tmp_path, [good, {**good, "task_id": "b", "split": "heldout"}])
    assert [t.task_id for t in load_tasks(two, "heldout")] == ["b"]
    cases = [([good, "{not json"], "line 2: invalid JSON"),
             ([{**good, "test": ""}], "line 1: field 'test'"),
             ([{k: v for k, v in good.items() if k != "entry_point"}], "field 'entry_point'"),
             ([{**good, "entry_point": "f()"}], "Python identifier"),
             ([good, good], "line 2: duplicate task_id"),
             (["[1, 2]"], "expected a JSON object")]
    for rows, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            load_tasks(write(tmp_path, rows))
    with pytest.raises(ValueError, match="split 'test'"):
        load_tasks(write(tmp_path, [good]), "test")
    with pytest.raises(ValueError, match="not found"):
        load_tasks(tmp_path / "missing.jsonl")


def test_a_task_the_harness_could_not_check_answers_against_is_refused_at_load(tmp_path):
    """Issue 26, item 6: a lone surrogate in a test failed every check of its task in `write_text`, after the
    answers were generated; such a file is now refused at load, naming the line, the task and the problem."""
    good = {"task_id": "a", "prompt": "def f():\n", "entry_point": "f", "test": "def check(c):\n    pass\n"}
    cases = [({**good, "test": 'def check(c):\n    assert c() != "\ud800"\n'},
              "line 2: task 'b': field 'test' is not encodable as UTF-8 (surrogates not allowed: '\\ud800'"),
             ({**good, "prompt": "def f():\n    '\udfff'\n"}, "line 2: task 'b': field 'prompt' is not encodable"),
             ({**good, "canonical_solution": "\ud800"}, "line 2: task 'b': field 'canonical_solution' is not encodable"),
             ({**good, "test": "def check(c):\n    assert c(\n"}, "line 2: task 'b': field 'test' does not parse"),
             ({**good, "test": "def check(c):\n    return\n\x00"}, "line 2: task 'b': field 'test' does not parse"),
             ({**good, "test": "def test(c):\n    pass\n"}, "line 2: task 'b': field 'test' defines no check(candidate)"),
             ({**good, "split": 3}, "line 2: field 'split' must be a string")]
    for row, message in cases:
        with pytest.raises(ValueError, match="^tasks.jsonl " + re.escape(message)):
            load_tasks(write(tmp_path, [good, {**row, "task_id": "b"}]))
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps(good).encode() + b"\n" +
                                            json.dumps({**good, "task_id": "b"}).encode().replace(b'"f"', b'"\xe9"'))
    with pytest.raises(ValueError, match="^latin1.jsonl line 2: not UTF-8"):
        load_tasks(tmp_path / "latin1.jsonl")


def test_the_project_task_set():
    tasks = load_tasks(PROJECT_TASKS)
    assert len(tasks) >= 40
    assert len({t.entry_point for t in tasks}) == len(tasks)
    assert len(load_tasks(PROJECT_TASKS, "heldout")) == 24
    assert {t.split for t in tasks} == {"dev", "heldout"}
    assert all(t.canonical_solution for t in tasks)


def test_every_canonical_solution_passes_and_an_empty_body_fails():
    tasks = load_tasks(PROJECT_TASKS)

    def verdicts(task: Task) -> tuple[str, str]:
        good = run_tests(program(task, task.canonical_solution), task.test, task.entry_point, task.prompt)
        empty = run_tests(program(task, "    pass\n"), task.test, task.entry_point, task.prompt)
        return good.status, empty.status

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip((t.task_id for t in tasks), pool.map(verdicts, tasks)))
    assert {k: v for k, v in results.items() if v[0] != "passed"} == {}
    assert {k: v for k, v in results.items() if v[1] == "passed"} == {}
