"""The engine as a standalone OpenAI-compatible HTTP server.

    python -m tokenrouter.launch_server --config_path config/tiny/pair.yaml [--host 127.0.0.1] [--port 30000] \\
        [--api-key KEY] [--request-timeout SECONDS]
"""
from __future__ import annotations

import argparse
import signal

import tokenrouter
from tokenrouter.service.http_server import start_http


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tokenrouter.launch_server", description=__doc__.splitlines()[0])
    p.add_argument("--config_path", "--config-path", required=True, help="engine YAML config")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=30000, help="0: any free port")
    p.add_argument("--api-key", "--api_key", default=None,
                   help="require `Authorization: Bearer KEY` on every path but /health")
    p.add_argument("--request-timeout", "--request_timeout", type=float, default=None,
                   help="seconds a request may run unless it sets its own `request_timeout` (default: no limit)")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise SystemExit("--request-timeout: must be > 0")
    with tokenrouter.serve(args.config_path) as svc:
        server = start_http(svc, args.host, args.port, api_key=args.api_key, request_timeout=args.request_timeout,
                            log_level=args.log_level)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: setattr(server.server, "should_exit", True))
        print(f"tokenrouter: serving {svc.models} from {args.config_path} on {server.url}", flush=True)
        server.wait()
        server.stop()


if __name__ == "__main__":
    main()
