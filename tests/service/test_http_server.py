"""Slow clients (issue 26, item 1): half-open connections used to hold uvicorn's connection count (every request,
/health included, then got a plain 503), and trickled bodies held the app's in-flight slots. Now a request's head
and body have deadlines, the connection cap closes the oldest connection without a complete request, and only
requests whose body is in count against the in-flight limit. Loopback only; every wait is bounded."""
from __future__ import annotations

import select
import socket
import time
from contextlib import ExitStack, closing
from urllib.parse import urlsplit

import httpx
import pytest

KEY = "flood-key"
OK = {"prompt": "hi", "max_tokens": 2}
ANSWER_SECONDS = 1.0  # the bound for /health and a keyed request during a flood
CLOSE_WAIT = 30.0  # the most seconds a test waits for the server to close a connection


def connect(url: str, data: bytes) -> socket.socket:
    host, port = urlsplit(url).hostname, urlsplit(url).port
    sock = socket.create_connection((host, port), timeout=CLOSE_WAIT)
    sock.sendall(data)
    return sock


def half_head(url: str) -> socket.socket:
    """The issue's slow-header client: a head that never ends."""
    return connect(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")


def slow_body(url: str) -> socket.socket:
    """The slow-body client: a complete head with a valid key, then 10 of the 1,000 bytes it declares."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    return connect(url, head.encode() + b'{"prompt":')


def closed_without_answer(sock: socket.socket) -> bool:
    """Whether the server closes `sock` (within CLOSE_WAIT) without writing a byte."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def answers_quickly(server) -> None:
    """/health and a keyed completion, each on a new connection, answered within ANSWER_SECONDS."""
    for method, path, body in (("GET", "/health", None), ("POST", "/v1/completions", OK)):
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as client:
            start = time.perf_counter()
            response = client.request(method, path, json=body)
            seconds = time.perf_counter() - start
        assert response.status_code == 200, (path, response.status_code, response.text[:300])
        assert seconds < ANSWER_SECONDS, f"{path} took {seconds:.2f} s during the flood"


@pytest.mark.parametrize("client,count,cap,in_flight", [(half_head, 48, 32, 8), (slow_body, 12, 64, 4)],
                         ids=["slow heads past the connection cap", "slow bodies past the in-flight limit"])
def test_a_flood_of_slow_clients_locks_no_one_out(serve_inprocess, client, count, cap, in_flight):
    """The slow heads are evicted at the cap or closed at the head deadline; the slow bodies never take an
    in-flight slot and are closed at the body deadline; neither gets an answer."""
    options = {"api_key": KEY, "max_connections": cap, "max_concurrent_requests": in_flight, "head_seconds": 2,
               "body_seconds": 3}
    with serve_inprocess(http_options=options) as (_, _http, server), ExitStack() as stack:
        flood = [stack.enter_context(closing(client(server.url))) for _ in range(count)]
        answers_quickly(server)
        assert all(closed_without_answer(s) for s in flood)


def test_trickling_bytes_does_not_extend_the_head_deadline(serve_inprocess):
    with serve_inprocess(http_options={"head_seconds": 1, "body_seconds": 2}) as (_, _http, server):
        with closing(half_head(server.url)) as sock:
            deadline = time.monotonic() + CLOSE_WAIT
            while time.monotonic() < deadline:
                readable, _, _ = select.select([sock], [], [], 0.2)  # a byte every 0.2 s until the server closes
                if readable:
                    break
                sock.sendall(b"x")
            assert readable and closed_without_answer(sock), "a trickling head was not closed"
        assert server.post("/v1/completions", OK).status_code == 200


def test_a_silent_connection_is_closed_and_a_kept_alive_one_serves_again(serve_inprocess):
    with serve_inprocess(http_options={"head_seconds": 1, "keep_alive_seconds": 5}) as (_, _http, server):
        with closing(connect(server.url, b"")) as silent:
            assert closed_without_answer(silent)
        with httpx.Client(base_url=server.url, timeout=30) as client:  # one connection, three requests
            for _ in range(3):
                assert client.post("/v1/completions", json=OK).status_code == 200
