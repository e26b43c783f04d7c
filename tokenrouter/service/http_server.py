"""Uvicorn on the engine's event loop: `start_http(svc, ...)` serves `build_app(svc)` from a socket bound
before it returns, so the URL is usable at once (connections wait in the backlog until uvicorn accepts)."""
from __future__ import annotations

import asyncio
import socket
from concurrent.futures import Future

import uvicorn

from tokenrouter.service.http import build_app


class HttpServer:
    """A running server: `url`, `stop()`, `wait()`; also a context manager."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, future: Future):
        self.server, self.socket, self.future = server, sock, future
        host, port = sock.getsockname()[:2]
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"

    def wait(self, timeout: float | None = None) -> None:
        """Block until the server stops (re-raises what stopped it, if anything)."""
        self.future.result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if not self.future.done():
            self.future.result(timeout)
        self.socket.close()

    def __enter__(self) -> HttpServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"HttpServer({self.url})"


def start_http(svc, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
               request_timeout: float | None = None, log_level: str = "warning") -> HttpServer:
    """Serve `svc` over HTTP on its own loop (port 0: any free port). Returns at once."""
    app = build_app(svc, api_key=api_key, request_timeout=request_timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"port: cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    config = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=5,
                            access_log=False)
    server = uvicorn.Server(config)
    future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), svc.loop)
    return HttpServer(server, sock, future)
