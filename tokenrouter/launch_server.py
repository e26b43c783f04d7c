"""The engine as a standalone OpenAI-compatible HTTP server.

    TOKENROUTER_API_KEY=... python -m tokenrouter.launch_server --config_path config/tiny/pair.yaml \\
        [--host 127.0.0.1] [--port 30000] [--api-key-file FILE] [--request-timeout SECONDS]
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import tokenrouter
from tokenrouter.bench.progress import ready_line
from tokenrouter.service.http import MAX_BODY_BYTES
from tokenrouter.service.http_server import (BODY_SECONDS, HEAD_SECONDS, KEEP_ALIVE_SECONDS, MAX_CONNECTIONS,
                                             check_exposure, start_http)

API_KEY_ENV = "TOKENROUTER_API_KEY"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tokenrouter.launch_server", description=__doc__.splitlines()[0])
    p.add_argument("--config_path", "--config-path", required=True, help="engine YAML config")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=30000, help="0: any free port")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key-file", "--api_key_file", default=None,
                     help=f"a file holding the API key (default: ${API_KEY_ENV}); every path but /health then "
                          "needs `Authorization: Bearer KEY`")
    key.add_argument("--api-key", "--api_key", default=None,
                     help=f"the API key itself; visible to every user in `ps`: prefer ${API_KEY_ENV} or --api-key-file")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without an API key")
    p.add_argument("--request-timeout", "--request_timeout", type=float, default=None,
                   help="the most seconds a request may run; a request's own `request_timeout` may only be shorter "
                        "(default: no limit)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, help="larger request bodies get 413")
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                   help="open connections; beyond, the oldest without a complete request is closed")
    p.add_argument("--keep-alive", type=float, default=KEEP_ALIVE_SECONDS, help="seconds an idle connection stays open")
    p.add_argument("--head-timeout", type=float, default=HEAD_SECONDS,
                   help="seconds a request's head may take to arrive, from the connection's opening (a kept-alive "
                        "connection's: from the request's first byte); then the connection is closed")
    p.add_argument("--body-timeout", type=float, default=BODY_SECONDS,
                   help="seconds a request's whole body may take to arrive, counted from the same moment")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, --api-key or $TOKENROUTER_API_KEY (None: no key)."""
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as e:
            raise SystemExit(f"--api-key-file: cannot read {args.api_key_file}: {e.strerror}") from None
        if not key:
            raise SystemExit(f"--api-key-file: {args.api_key_file} is empty")
        return key
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise SystemExit("--request-timeout: must be > 0")
    for name in ("keep_alive", "head_timeout", "body_timeout"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"--{name.replace('_', '-')}: must be > 0")
    for name in ("max_body_bytes", "max_connections"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be >= 1")
    key = api_key(args)
    try:
        check_exposure(args.host, key, args.allow_unauthenticated)  # before any model loads
    except PermissionError as e:
        raise SystemExit(str(e)) from None
    with tokenrouter.serve(args.config_path, announce=False) as svc:
        server = start_http(svc, args.host, args.port, api_key=key, request_timeout=args.request_timeout,
                            log_level=args.log_level, allow_unauthenticated=args.allow_unauthenticated,
                            max_connections=args.max_connections, keep_alive_seconds=args.keep_alive,
                            head_seconds=args.head_timeout, body_seconds=args.body_timeout,
                            max_body_bytes=args.max_body_bytes)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: setattr(server.server, "should_exit", True))
        print(ready_line(svc, server.url), file=sys.stderr, flush=True)  # each model's dtype, kernels, memory
        print(f"tokenrouter: serving {svc.models} from {args.config_path} on {server.url}"
              f"{'' if key else ' without an API key'}", flush=True)
        server.wait()
        server.stop()


if __name__ == "__main__":
    main()
