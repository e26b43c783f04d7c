"""Benchmarks and baselines; `python -m tokenrouter.bench --help` lists the commands."""
from __future__ import annotations

import json


def write_json(path: str, result: dict) -> None:
    """Write a benchmark's result where --json asked (nothing when the path is empty)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
