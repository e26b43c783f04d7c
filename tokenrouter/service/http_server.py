"""Uvicorn on the engine's event loop: `start_http(svc, ...)` serves `build_app(svc)` from a socket bound
before it returns, so the URL is usable at once (connections wait in the backlog until uvicorn accepts)."""
from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from concurrent.futures import Future

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenrouter.service.http import build_app
from tokenrouter.service.openai_protocol import error_json

MAX_CONNECTIONS = 1088
CONNECTION_HEADROOM = 64  # connections uvicorn admits beyond the app's in-flight limit (idle keep-alives)
KEEP_ALIVE_SECONDS = 5.0


def check_exposure(host: str, api_key: str | None, allow_unauthenticated: bool = False) -> None:
    """Refuse (PermissionError) to serve a non-loopback address without an API key unless told to."""
    if not api_key and not allow_unauthenticated and not is_loopback(host):
        raise PermissionError(f"host: {host!r} is reachable from other machines and no API key is set; set one "
                              "(TOKENROUTER_API_KEY or --api-key-file) or pass --allow-unauthenticated")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class OpenAIErrorsH11(H11Protocol):
    """Uvicorn's h11 protocol, whose own 400 for a request it cannot parse (a request line, header or
    Content-Length h11 refuses) is OpenAI-shaped JSON instead of plain text."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_json(f"request: malformed HTTP ({msg.rstrip('.')})", 400)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


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
        self.server.config.app.state.tokenizer.shutdown(wait=False)

    def __enter__(self) -> HttpServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"HttpServer({self.url})"


def start_http(svc, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
               request_timeout: float | None = None, log_level: str = "warning", allow_unauthenticated: bool = False,
               max_connections: int = MAX_CONNECTIONS, keep_alive_seconds: float = KEEP_ALIVE_SECONDS,
               **app_options) -> HttpServer:
    """Serve `svc` over HTTP on its own loop (port 0: any free port). Returns at once. Binding anything but
    a loopback address without `api_key` raises unless `allow_unauthenticated`. Uvicorn closes idle
    keep-alive connections after `keep_alive_seconds` and answers a plain 503 beyond `max_connections`
    (the app's own in-flight limit, an OpenAI-shaped 503, sits below it). `app_options` go to `build_app`."""
    check_exposure(host, api_key, allow_unauthenticated)
    in_flight = app_options.setdefault("max_concurrent_requests", max(1, max_connections - CONNECTION_HEADROOM))
    app = build_app(svc, api_key=api_key, request_timeout=request_timeout, **app_options)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"port: cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    config = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=5, access_log=False,
                            limit_concurrency=max(max_connections, in_flight + 1),
                            timeout_keep_alive=keep_alive_seconds, http=OpenAIErrorsH11)
    server = uvicorn.Server(config)
    future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), svc.loop)
    return HttpServer(server, sock, future)
