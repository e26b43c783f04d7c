"""The proofs of concept of issue 13 against the HTTP server: each is refused with an OpenAI-shaped error that
names the field, and the engine keeps serving everyone else."""
from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from prometheus_client.parser import text_string_to_metric_families

from tokenrouter.policies.checkpoint import default_router_path
from tokenrouter.service.http import MAX_BODY_BYTES
from tokenrouter.service.openai_protocol import MAX_STOP_STRINGS, redact_paths

ROOT = Path(__file__).resolve().parents[2]

OK = {"prompt": "hi", "max_tokens": 3}


def assert_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and isinstance(error["type"], str) and error["message"]
    if param is not None:
        assert error["param"] == param and error["message"].startswith(param)
    return error


def assert_serving(server) -> None:
    assert server.post("/v1/completions", OK).status_code == 200
    assert server.http.get("/health").json()["status"] == "ok"


def test_a_20_mb_body_is_413(server):
    huge = {"prompt": "x" * (20 << 20)}
    assert_error(server.post("/v1/completions", huge), 413, "request_too_large", "body")

    def chunks():  # no Content-Length: refused while reading
        for _ in range(20):
            yield b"x" * (1 << 20)

    response = server.http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(response, 413, "request_too_large", "body")
    assert_serving(server)


def test_a_body_just_under_the_limit_is_read(server):
    body = b'{"prompt": "hi", "user": "' + b"u" * (MAX_BODY_BYTES - 64) + b'", "max_tokens": 2}'
    response = server.http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text[:500]


@pytest.mark.parametrize("stop", [[f"s{i}" for i in range(100)], ["x" * 10_000], "x" * 10_000])
def test_stop_strings_are_bounded(server, stop):
    for stream in (False, True):
        assert_error(server.post("/v1/completions", {**OK, "stop": stop, "stream": stream}), 400, "invalid_request",
                     "stop")
    ok = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert server.post("/v1/completions", {**OK, "stop": ok}).status_code == 200


@pytest.mark.parametrize("routing", [
    {"policy": "neural", "path": "/etc/passwd"},
    {"policy": "neural", "path": "/no/such/file"},
    {"policy": "neural:path=/etc/passwd"},
    {"policy": "rolling", "of": "probe", "path": "/etc/passwd"},
])
def test_requests_cannot_name_files(server, routing):
    """`routing.path` used to make the server load any path, and its error said whether the file exists."""
    error = assert_error(server.post("/v1/completions", {**OK, "routing": routing}), 400, "invalid_request",
                         "routing.path")
    assert "/etc/passwd" not in error["message"] and "not found" not in error["message"]
    assert_serving(server)


@pytest.mark.parametrize("routing,param", [
    ({"policy": "confidence", "threshold": [0.5]}, "routing.threshold"),  # unhashable: was a text/plain 500
    ({"policy": "confidence", "threshold": {"a": 1}}, "routing.threshold"),
    ({"policy": "confidence", "threshold": "high"}, "routing.threshold"),
    ({"policy": "confidence", "threshold": True}, "routing.threshold"),
    ({"policy": "schedule", "every": 2.5}, "routing.every"),
    ({"policy": "rolling", "of": "entropy", "window": 10**30}, "routing.window"),
    ({"policy": "confidence", "bogus": 1}, "routing.bogus"),
    ({"policy": "rolling", "of": "entropy", "bogus": 1}, "routing.bogus"),
    ({"policy": "rolling", "of": ["entropy"]}, "routing.of"),
    ({"policy": "logu", "kind": "k" * 10_000}, "routing.kind"),
    ({"policy": 7}, "routing.policy"),
])
def test_routing_parameters_are_checked_against_the_policy(server, routing, param):
    assert_error(server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                       "routing": routing}), 400, "invalid_request", param)


def test_a_router_trained_for_other_models_is_refused_before_it_can_fail_a_step(server):
    """The shipped routers read the embedded pair's hidden size; on the tiny pair a step used to raise and
    fail the engine for everyone."""
    for policy in ("neural", "probe", "query-classifier", "rolling:of=neural"):
        assert_error(server.post("/v1/completions", {**OK, "routing": {"policy": policy}}), 400, "invalid_request",
                     "routing.policy")
    assert_serving(server)


def test_a_refused_router_does_not_reveal_where_the_server_keeps_it(server):
    """The 400 for a router trained for other models named the shipped checkpoint's absolute path."""
    for policy in ("neural", "probe", "query-classifier", "rolling:of=neural"):
        message = server.post("/v1/completions", {**OK, "routing": {"policy": policy}}).json()["error"]["message"]
        name = "query" if policy == "query-classifier" else "neural" if "neural" in policy else policy
        for secret in (str(default_router_path(name)), str(default_router_path(name).parent), str(ROOT),
                       str(Path.home())):
            assert secret not in message, message
        assert "trained" in message and "<server file>" in message  # still says why, and that it is a file


@pytest.mark.parametrize("text,redacted", [
    ("path: router '/srv/app/routers/neural.pt' was trained", "path: router '<server file>' was trained"),
    ("no such file /root/.cache/x (from config=/etc/tr.yaml)", "no such file <server file> (from config=<server file>)"),
    ("threshold: must be in [0, 1], got 1.5", "threshold: must be in [0, 1], got 1.5"),
    ("tokens/s 3/4 and a/b", "tokens/s 3/4 and a/b"),
])
def test_paths_are_redacted_from_messages(text, redacted):
    assert redact_paths(text) == redacted


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/v1/nothing-here", 404, "not_found"),
    ("GET", "/v1/completions", 405, "method_not_allowed"),
    ("DELETE", "/v1/models", 405, "method_not_allowed"),
])
def test_unknown_routes_and_methods_are_openai_errors(server, method, path, status, code):
    response = server.http.request(method, path)
    assert_error(response, status, code)
    if status == 405:
        assert response.headers["allow"]


def test_unknown_paths_do_not_grow_the_metrics(server):
    for i in range(20):
        server.http.get(f"/probe-{i}")
    text = server.http.get("/metrics").text
    assert "probe-" not in text and 'endpoint="other"' in text


def test_a_wrong_key_of_the_right_length_is_refused(server):
    wrong = "x" * len(server.api_key)
    for key in (wrong, server.api_key[:-1], server.api_key + "x"):
        response = httpx.post(f"{server.url}/v1/completions", json=OK, headers={"Authorization": f"Bearer {key}"})
        assert_error(response, 401, "invalid_api_key")


def test_an_unhandled_error_is_an_openai_500_and_the_engine_goes_on(serve_inprocess):
    with serve_inprocess() as (svc, _, server):
        def broken():
            raise RuntimeError("simulated bug")

        svc._stats = broken  # NOTE: /metrics reads it on the engine loop
        assert_error(server.http.get("/metrics"), 500, "internal_error")
        assert_serving(server)


def test_503s_say_when_to_retry(serve_inprocess, stall):
    with serve_inprocess(scheduler={"max_queued_requests": 1}) as (svc, _, server):
        with stall(svc), server.http.stream("POST", "/v1/completions", json={**OK, "stream": True}) as first:
            assert first.status_code == 200
            refused = server.post("/v1/completions", OK)
            assert_error(refused, 503, "engine_overloaded")
            assert int(refused.headers["retry-after"]) >= 1
        server.wait_idle()


def test_requests_beyond_the_in_flight_limit_are_503(serve_inprocess, stall):
    with serve_inprocess(http_options={"max_concurrent_requests": 2}) as (svc, _, server):
        with stall(svc), server.http.stream("POST", "/v1/completions", json={**OK, "stream": True}) as a, \
                server.http.stream("POST", "/v1/completions", json={**OK, "stream": True}) as b:
            assert a.status_code == b.status_code == 200
            refused = server.http.get("/v1/models")
            assert_error(refused, 503, "engine_overloaded")
            assert refused.headers["retry-after"]
        server.wait_idle()
        assert_serving(server)


def test_the_servers_timeout_caps_the_clients(serve_inprocess, stall):
    """The client's `request_timeout` used to replace the server's."""
    with serve_inprocess(http_options={"request_timeout": 0.2}) as (svc, _, server):
        with stall(svc):
            late = server.post("/v1/completions", {**OK, "max_tokens": 50, "request_timeout": 3600})
            error = assert_error(late, 504, "request_timeout", "request_timeout")
            assert "0.2 s" in error["message"]
        server.wait_idle()


def test_tokenization_runs_off_the_engine_loop(serve_inprocess):
    with serve_inprocess() as (svc, _, server):
        threads = []
        prepare = svc.prepare

        def recording(*args, **kwargs):
            threads.append(threading.current_thread())
            return prepare(*args, **kwargs)

        svc.prepare = recording
        assert server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2}).status_code == 200
        assert server.post("/v1/completions", OK).status_code == 200
        assert len(threads) == 2 and svc._thread not in threads


def test_policy_instances_from_requests_are_bounded(serve_inprocess):
    with serve_inprocess(http_options={"policy_cache_size": 4}) as (svc, http, server):
        for i in range(12):
            body = {**OK, "max_tokens": 1, "routing": {"policy": "confidence", "threshold": i / 100}}
            assert server.post("/v1/completions", body).status_code == 200
        assert len(http.server.config.app.state.policies) == 4


def test_connections_are_bounded_by_deadlines_not_by_uvicorns_connection_count(serve_inprocess):
    options = {"max_connections": 100, "keep_alive_seconds": 2, "head_seconds": 3, "body_seconds": 4}
    with serve_inprocess(http_options=options) as (_, http, _server):
        config = http.server.config
        assert config.limit_concurrency is None and config.timeout_keep_alive == 2  # (it 503'd every request)
        protocol = config.http_protocol_class
        assert (protocol.head_seconds, protocol.body_seconds, protocol.max_connections) == (3, 4, 100)


def test_a_non_loopback_bind_needs_a_key():
    from tokenrouter.service.http_server import check_exposure

    with pytest.raises(PermissionError, match="--allow-unauthenticated"):
        check_exposure("0.0.0.0", None)
    with pytest.raises(PermissionError):
        check_exposure("192.168.1.10", "")
    check_exposure("0.0.0.0", "key")
    check_exposure("0.0.0.0", None, allow_unauthenticated=True)
    for host in ("127.0.0.1", "::1", "localhost", "127.1.2.3"):
        check_exposure(host, None)


@pytest.mark.parametrize("body", [{"prompt": [-1]}, {"prompt": [10**9]}, {"prompt": "hi", "temperature": 1e-38}],
                         ids=["token id -1", "token id 1e9", "temperature 1e-38"])
def test_out_of_range_token_ids_and_tiny_temperatures_harm_no_one(serve_inprocess, body):
    with serve_inprocess() as (svc, _, server):
        response = server.post("/v1/completions", {**body, "max_tokens": 3})
        assert response.status_code in (200, 400), response.text
        assert svc.error is None
        assert_serving(server)


def outcomes(server, endpoint: str) -> dict[str, float]:
    """`tokenrouter_requests_total` of one endpoint, by outcome."""
    families = text_string_to_metric_families(server.http.get("/metrics").text)
    return {s.labels["outcome"]: s.value for f in families if f.name == "tokenrouter_requests"
            for s in f.samples if s.name.endswith("_total") and s.labels["endpoint"] == endpoint}


def post_escaped(server, path: str, body):
    """`body` as Python's json module writes it: a lone surrogate travels as its escape, `\\ud800`."""
    return server.http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udc00b"}], "max_tokens": 2},
     "messages.0.content"),
])
def test_a_lone_surrogate_is_a_400_counted_as_one(server, path, body, param):
    """Issue 26: the tokenizer's TypeError made it a 500, and the metrics counted a 500."""
    before = outcomes(server, path)
    assert_error(post_escaped(server, path, body), 400, "invalid_request", param)
    after = outcomes(server, path)
    assert after.get("500", 0) == before.get("500", 0) and after["400"] == before.get("400", 0) + 1
    assert_serving(server)


@pytest.mark.parametrize("body,param", [
    ({**OK, "\ud800": 1}, None),  # an unknown field whose name is no text
    ({**OK, "routing": {"policy": "logu", "kind": "\ud800"}}, None),
    ({**OK, "routing": {"policy": "rolling", "of": "\ud800"}}, None),
    ({**OK, "routing": {"policy": "\ud800:x=1"}}, None),
    ({**OK, "model": "\udfff"}, "model"),
])
def test_a_lone_surrogate_anywhere_else_is_still_an_openai_error(server, body, param):
    response = post_escaped(server, "/v1/completions", body)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)


@pytest.mark.parametrize("method,path", [("POST", "/v1/completions/"), ("POST", "/v1/chat/completions/"),
                                         ("GET", "/v1/models/"), ("GET", "/health/")])
def test_a_trailing_slash_is_not_redirected(server, method, path):
    """Issue 26: a 307 to the path without the slash (a client that follows it sends its body twice)."""
    response = server.http.request(method, path, json=OK if method == "POST" else None)
    error = assert_error(response, 404, "not_found")
    assert path.rstrip("/") in error["message"] and "location" not in response.headers


@pytest.mark.parametrize("head", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000000000000000\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
], ids=["oversized Content-Length", "negative Content-Length", "no request line", "header without a colon"])
def test_the_http_parsers_own_errors_are_openai_shaped(server, head):
    """Issue 26: the HTTP parser answered these with a plain-text 400 before the app saw them."""
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(head)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    status_line, _, rest = raw.partition(b"\r\n")
    headers, _, content = rest.partition(b"\r\n\r\n")
    assert status_line.split(b" ")[1] == b"400", raw
    assert b"content-type: application/json" in headers.lower(), raw
    error = json.loads(content)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_request"
    assert_serving(server)
