"""Benchmarks: `python -m tokenrouter.bench COMMAND ...`; each prints a table and writes JSON with --json.
Every argument is checked before any model loads: a bad one exits at once (status 2) with one message."""
from __future__ import annotations

import argparse

from tokenrouter.bench import acceptance, checks, first_start, pilot, quality, runner, serve, simulate, sweep

COMMANDS = {"runner": runner, "serve": serve, "sweep": sweep, "quality": quality, "pilot": pilot,
            "acceptance": acceptance, "simulate": simulate, "first-start": first_start}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tokenrouter.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    parsers = {}
    for name, module in COMMANDS.items():
        parsers[name] = sub.add_parser(name, help=module.__doc__.strip().splitlines()[0])
        module.add_arguments(parsers[name])
    args = parser.parse_args(argv)
    checks.before_work(parsers[args.command], COMMANDS[args.command].check_args, args)
    COMMANDS[args.command].run(args)


if __name__ == "__main__":
    main()
