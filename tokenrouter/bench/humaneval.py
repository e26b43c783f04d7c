"""Tasks in the HumanEval JSONL format (`task_id`, `prompt`, `entry_point`, `test`; `canonical_solution`
and `split` optional), the request each task sends, the code taken out of a response, and the program
the sandbox runs: prompt and code (the task's `check(entry_point)` runs beside it, in a process of its own)."""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from tokenrouter.bench import read_jsonl

PROJECT_TASKS = Path(__file__).parent / "tasks" / "tokenrouter_tasks.jsonl"
REQUIRED = ("task_id", "prompt", "entry_point", "test")
OPTIONAL = ("canonical_solution", "split")
MODES = ("chat", "completion")
INSTRUCTION = ("Complete the following Python code. Reply with the complete code (imports and the whole "
               "function or class, without tests or examples) in one ```python code block.\n\n```python\n{prompt}```")
FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
PYTHON_FENCES = ("", "python", "py", "python3")
CODE_START = re.compile(r"^(?:import |from |def |class |async def |@)")


@dataclass(slots=True)
class Task:
    task_id: str
    prompt: str
    entry_point: str
    test: str
    canonical_solution: str = ""
    split: str = ""


def load_tasks(path: str | Path = PROJECT_TASKS, split: str = "") -> list[Task]:
    """Read a task file; with `split`, only the tasks whose `split` field equals it. Raises ValueError
    naming the line and field of a malformed task, and of one the harness could not check answers against
    (a text not encodable as UTF-8, a test that does not parse or defines no `check`): such a file is refused
    before any answer is generated."""
    tasks, seen = [], set()
    for where, row in read_jsonl(path, "tasks"):
        for key in REQUIRED:
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise ValueError(f"{where}: field {key!r} must be a non-empty string")
        for key in OPTIONAL:
            if not isinstance(row.get(key) or "", str):
                raise ValueError(f"{where}: field {key!r} must be a string")
        if not row["entry_point"].isidentifier():
            raise ValueError(f"{where}: field 'entry_point' must be a Python identifier, got {row['entry_point']!r}")
        if problem := unusable(row):
            raise ValueError(f"{where}: task {row['task_id']!r}: {problem}")
        if row["task_id"] in seen:
            raise ValueError(f"{where}: duplicate task_id {row['task_id']!r}")
        seen.add(row["task_id"])
        tasks.append(Task(*(row[k] for k in REQUIRED), row.get("canonical_solution") or "", row.get("split") or ""))
    if split:
        tasks = [t for t in tasks if t.split == split]
    if not tasks:
        raise ValueError(f"tasks: no tasks in {path}" + (f" with split {split!r}" if split else ""))
    return tasks


def unusable(row: dict) -> str:
    """Why the harness could not check answers against this task ('' when it can): a field it writes to a
    file that UTF-8 cannot encode (a lone surrogate), or a test that does not parse or defines no `check`."""
    for key in (*REQUIRED, *OPTIONAL):
        try:
            (row.get(key) or "").encode()
        except UnicodeEncodeError as e:
            found = e.object[e.start:e.end]
            return f"field {key!r} is not encodable as UTF-8 ({e.reason}: {found!r} at character {e.start})"
    try:
        tree = ast.parse(row["test"])
    except SyntaxError as e:
        return f"field 'test' does not parse: {e.msg} (line {e.lineno} of the test)"
    except (ValueError, RecursionError, MemoryError) as e:
        return f"field 'test' does not parse: {type(e).__name__}: {e}"
    if not any(isinstance(node, ast.FunctionDef) and node.name == "check" for node in tree.body):
        return "field 'test' defines no check(candidate) function"
    return ""


def request(task: Task, mode: str = "chat") -> dict:
    """generate() arguments for one task: an instruction in a chat message, or the raw prompt to continue."""
    if mode == "chat":
        return {"prompt": INSTRUCTION.format(prompt=task.prompt)}
    if mode == "completion":
        return {"prompt": task.prompt, "raw": True}
    raise ValueError(f"mode: must be one of {MODES}, got {mode!r}")


def defines(code: str, name: str) -> bool:
    return re.search(rf"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+{re.escape(name)}\b", code, re.M) is not None


def extract_code(response: str, entry_point: str) -> str:
    """The code in a response: the first Python fenced block that defines `entry_point` (else the first
    Python block; an unclosed fence runs to the end), else unfenced code from its first statement when it
    defines `entry_point` (up to where it stops parsing), else the response itself as a completion of the prompt."""
    blocks = [body for lang, body in FENCE.findall(response) if lang.lower() in PYTHON_FENCES]
    if blocks:
        return next((b for b in blocks if defines(b, entry_point)), blocks[0])
    if defines(response, entry_point):
        lines = response.splitlines()
        start = next(i for i, line in enumerate(lines) if CODE_START.match(line) or defines(line, entry_point))
        return longest_parsable(lines[start:])
    return response


def longest_parsable(lines: list[str]) -> str:
    """The longest run of leading lines that parses as Python (prose after unfenced code is dropped)."""
    for end in range(len(lines), 0, -1):
        code = "\n".join(lines[:end])
        try:
            ast.parse(code)
            return code
        except SyntaxError:
            continue
    return "\n".join(lines)


def truncate_completion(code: str) -> str:
    """A completion ends at its first top-level statement: the function body it continues is over."""
    lines = code.split("\n")
    for i, line in enumerate(lines[1:], 1):
        if line.strip() and not line[0].isspace():
            return "\n".join(lines[:i])
    return code


def program(task: Task, code: str) -> str:
    """The candidate's program the sandbox runs (the task's tests run in a process of their own, against its
    `entry_point`: `sandbox.run_tests`). Code that defines the entry point follows the whole prompt (its imports
    and helpers stay; the new definition replaces the stub); other code continues it."""
    return f"{task.prompt}\n{code}" if defines(code, task.entry_point) else task.prompt + truncate_completion(code)
