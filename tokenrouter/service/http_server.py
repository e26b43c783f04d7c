"""Uvicorn on the engine's event loop: `start_http(svc, ...)` serves `build_app(svc)` from a socket bound
before it returns, so the URL is usable at once (connections wait in the backlog until uvicorn accepts).

Uvicorn's own limits do not stop a slow client: it has no deadline for a request's head or body, and its
`limit_concurrency` counts open connections, so 1,100 half-open ones made it answer every request (/health too)
with a 503. Its h11 protocol is therefore subclassed (`DeadlineH11`): a deadline for each request's head and one
for its body, and at the connection cap the oldest connection without a complete request is closed to make room;
uvicorn's `limit_concurrency` is off, and the app's in-flight limit counts only requests whose body is in."""
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
CONNECTION_HEADROOM = 64  # connections beyond the app's in-flight limit (idle keep-alives, requests arriving)
KEEP_ALIVE_SECONDS = 5.0
HEAD_SECONDS, BODY_SECONDS = 5.0, 10.0  # a request's head, then its whole body, must arrive within these


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


class DeadlineH11(OpenAIErrorsH11):
    """Closes a connection whose request head has not arrived `head_seconds` after the connection opened (or,
    on a kept-alive connection, after the request's first byte), or whose body has not arrived `body_seconds`
    after that same moment; a slow client cannot reset them by trickling bytes. Beyond `max_connections` open, a
    new connection closes the oldest one that holds no complete request (waiting for a head or a body, or idle
    between requests); if every one holds a request in progress, the new one is closed. The numbers are class
    attributes: `start_http` makes a subclass per server."""
    head_seconds, body_seconds, max_connections = HEAD_SECONDS, BODY_SECONDS, MAX_CONNECTIONS

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.started, self.deadline = self.loop.time(), None
        self.arm(self.head_seconds)
        if len(self.connections) > self.max_connections:
            victims = [c for c in self.connections if isinstance(c, DeadlineH11) and c.waiting]
            min(victims, key=lambda c: c.started, default=self).transport.close()

    @property
    def waiting(self) -> bool:
        """No complete request: the app has nothing of this connection's to answer."""
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing()

    def data_received(self, data: bytes) -> None:
        if self.deadline is None and self.conn.their_state is h11.IDLE:  # a kept-alive connection's next request
            self.started = self.loop.time()
            self.arm(self.head_seconds)
        super().data_received(data)
        self.follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.deadline is None:  # the request was complete; the next starts now (pipelined) or at its first byte
            self.started = self.loop.time()
            self.follow()  # NOTE: idle, uvicorn's keep-alive timeout holds until the next byte

    def connection_lost(self, exc) -> None:
        self.disarm()
        super().connection_lost(exc)

    def follow(self) -> None:
        """The deadline of the phase the client's side is in: head (IDLE), body (SEND_BODY), none once the
        request is complete."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self.deadline is None or self.deadline[0] != "body":
                self.arm(self.body_seconds, "body")
        elif state is not h11.IDLE:
            self.disarm()

    def arm(self, seconds: float, phase: str = "head") -> None:
        self.disarm()
        self.deadline = (phase, self.loop.call_at(self.started + seconds, self.expire))

    def disarm(self) -> None:
        if getattr(self, "deadline", None) is not None:
            self.deadline[1].cancel()
            self.deadline = None

    def expire(self) -> None:
        self.deadline = None
        if not self.transport.is_closing():
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
        for pool in self.server.config.app.state.pools:
            pool.shutdown(wait=False)

    def __enter__(self) -> HttpServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"HttpServer({self.url})"


def start_http(svc, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
               request_timeout: float | None = None, log_level: str = "warning", allow_unauthenticated: bool = False,
               max_connections: int = MAX_CONNECTIONS, keep_alive_seconds: float = KEEP_ALIVE_SECONDS,
               head_seconds: float = HEAD_SECONDS, body_seconds: float = BODY_SECONDS, **app_options) -> HttpServer:
    """Serve `svc` over HTTP on its own loop (port 0: any free port). Returns at once. Binding anything but
    a loopback address without `api_key` raises unless `allow_unauthenticated`. Uvicorn closes idle
    keep-alive connections after `keep_alive_seconds`; a request's head and body must arrive within
    `head_seconds` and `body_seconds`, and beyond `max_connections` the oldest connection without a complete
    request is closed (`DeadlineH11`). The app's in-flight limit (an OpenAI-shaped 503) defaults to
    `max_connections` less some headroom. `app_options` go to `build_app`."""
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
    protocol = type("DeadlineH11", (DeadlineH11,), {"head_seconds": head_seconds, "body_seconds": body_seconds,
                                                    "max_connections": max(max_connections, in_flight + 1)})
    config = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=5, access_log=False,
                            limit_concurrency=None, timeout_keep_alive=keep_alive_seconds, http=protocol)
    server = uvicorn.Server(config)
    future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), svc.loop)
    return HttpServer(server, sock, future)
