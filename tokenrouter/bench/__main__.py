"""Benchmarks: `python -m tokenrouter.bench COMMAND ...`; each prints a table and writes JSON with --json."""
from __future__ import annotations

import argparse

from tokenrouter.bench import pilot, quality, runner, serve, sweep

COMMANDS = {"runner": runner, "serve": serve, "sweep": sweep, "quality": quality, "pilot": pilot}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tokenrouter.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.__doc__.strip().splitlines()[0]))
    args = parser.parse_args(argv)
    COMMANDS[args.command].run(args)


if __name__ == "__main__":
    main()
