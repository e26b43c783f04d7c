"""Benchmarks and baselines; `python -m tokenrouter.bench --help` lists the commands."""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path


def write_json(path: str, result: dict) -> None:
    """Write a benchmark's result where --json asked (nothing when the path is empty); NaN and infinity,
    which strict JSON has no words for, are written as null."""
    if path:
        with open(path, "w") as f:
            json.dump(_finite(result), f, indent=2, allow_nan=False)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def read_jsonl(path: str | Path, what: str) -> Iterator[tuple[str, dict]]:
    """The objects of a JSONL file, each with where it stands ("file.jsonl line 3") for error messages;
    blank lines are skipped. Raises ValueError naming the file (`what` names the argument) or the line (one
    that is not UTF-8 included). Lines end at LF or CR only (U+2028 in a JSON string ends none)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what}: file not found: {path}")
    for number, raw in enumerate(path.read_bytes().splitlines(), 1):
        where = f"{path.name} line {number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where}: not UTF-8 ({e.reason} at byte {e.start + 1})") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON: {e}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object")
        yield where, row
