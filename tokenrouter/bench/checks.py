"""Command-line arguments checked before any model work: every policy spec parsed and built, task and
prompt files read, configs loaded, numbers in range. A bad argument ends the command with one line naming
it (exit status 2, as argparse's own errors) instead of failing after minutes of generation."""
from __future__ import annotations

import argparse
from collections.abc import Callable

from tokenrouter.config import EngineConfig, load_config
from tokenrouter.policies import Policy, parse_policy


def before_work(parser: argparse.ArgumentParser, check: Callable[[argparse.Namespace], object],
                args: argparse.Namespace) -> None:
    """Run `check(args)`; a ValueError it raises exits at once with its message."""
    try:
        check(args)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")


def config(path: str, argument: str = "--config") -> EngineConfig:
    try:
        return load_config(path)
    except ValueError as e:
        raise ValueError(f"{argument}: {e}") from None


def policies(specs: list[str], argument: str, level: str | None = None) -> list[Policy]:
    """Each spec built (which validates its parameters); with `level`, each must be of that level."""
    built = []
    for spec in specs:
        try:
            policy = parse_policy(spec)
        except ValueError as e:
            raise ValueError(f"{argument}: {spec!r}: {e}") from None
        found = getattr(policy, "level", "token")
        if level is not None and found != level:
            raise ValueError(f"{argument}: {spec!r} is a {found}-level policy, expected {level}-level")
        built.append(policy)
    return built


def tasks(path: str, split: str = "", argument: str = "--tasks") -> list:
    from tokenrouter.bench.humaneval import load_tasks

    try:
        return load_tasks(path, split)
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith("tasks:") else f"{argument}: {e}") from None


def levels(text: str, argument: str = "--concurrency") -> list[int]:
    """Comma-separated integers >= 1 ("1,4,16")."""
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"{argument}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{argument}: expected integers >= 1, got {text!r}")
    return values


def at_least(value: float, minimum: float, argument: str) -> None:
    if not value >= minimum:
        raise ValueError(f"{argument}: must be >= {minimum:g}, got {value!r}")


def above(value: float, bound: float, argument: str) -> None:
    if not value > bound:
        raise ValueError(f"{argument}: must be > {bound:g}, got {value!r}")


def fraction(value: float, argument: str) -> None:
    if not 0 <= value <= 1:
        raise ValueError(f"{argument}: must be in [0, 1], got {value!r}")
