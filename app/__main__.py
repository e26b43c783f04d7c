"""python -m app [--config PATH | --server URL] [--policy SPEC] [--host 127.0.0.1] [--port 7860]"""
from __future__ import annotations

import argparse

import tokenrouter
from app import launch
from tokenrouter.bench import checks, progress
from tokenrouter.config import default_config


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m app", description="The TokenRouter Workbench Gradio app.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--config", default=default_config(),
                        help="start an in-process engine on this config (default: the embedded pair, dtype auto)")
    source.add_argument("--server", help="use a running server (python -m tokenrouter.launch_server) instead")
    p.add_argument("--policy", help="the policy the generation tab starts with (default: the config's)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=None, help="default: 7860 or the next free port")
    args = p.parse_args(argv)
    checks.before_work(p, check_args, args)
    service = tokenrouter.connect(args.server) if args.server else tokenrouter.serve(args.config, announce=False)
    try:
        args.port = progress.ready(service, args.host, args.port)  # the one ready line: models, memory, URL
        launch(service, policy=args.policy, server_name=args.host, server_port=args.port)
    finally:
        service.close()


def check_args(args: argparse.Namespace) -> None:
    """The config and the starting policy, before the engine loads (raises ValueError naming the argument)."""
    if not args.server:
        checks.config(args.config)
    if args.policy:
        checks.policies([args.policy], "--policy")


if __name__ == "__main__":
    main()
