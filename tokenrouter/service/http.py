"""The OpenAI-compatible HTTP API over one in-process Service. The app runs on the engine's own event loop
(see `http_server.py`), so handlers talk to the runtime directly and every abort lands at a step boundary;
what costs time in proportion to what a client sends runs on small thread pools instead: parsing and validating
a body (`request_bounds`), and tokenizing a prompt (cut off once it exceeds the context). Every error is
OpenAI-shaped (`openai_protocol.error_json`)."""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenrouter.engine.runtime import EngineOverloaded
from tokenrouter.service.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from tokenrouter.service.openai_protocol import (OVERLOADED, ChatRequest, CompletionRequest, GenerationRequest,
                                                 ResponseIds, error_json, redact_paths)
from tokenrouter.service.policy_cache import PolicyCache
from tokenrouter.service.request_bounds import BadBody, Bounds, parse_body
from tokenrouter.service.routed_request import RoutedRequest

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 4 << 20
MAX_CONCURRENT_REQUESTS = 1024
PARSE_THREADS = TOKENIZE_THREADS = 2
UNLIMITED = ("/health", "/metrics")  # answered outside the in-flight limit
RETRY_AFTER_OVERLOADED, RETRY_AFTER_FAILED = 1, 30  # seconds (Retry-After on 503)


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def build_app(svc, api_key: str | None = None, request_timeout: float | None = None,
              model_name: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
              max_concurrent_requests: int = MAX_CONCURRENT_REQUESTS, policy_cache_size: int = 64) -> FastAPI:
    """`request_timeout`: the most seconds a request may run (a request's own `request_timeout` may only be
    shorter); None: no limit. `model_name`: the id /v1/models lists (default: the config file's stem);
    requests may name it, one of the engine's models, or nothing. Bodies over `max_body_bytes` get 413,
    requests beyond `max_concurrent_requests` in flight get 503 (a request counts once its body is in; /health
    and /metrics never count); at most `policy_cache_size` policy instances built from requests are kept."""
    served = model_name or Path(svc.config.path).stem or "tokenrouter"
    metrics = ServerMetrics(svc.models)
    policies = PolicyCache(svc, policy_cache_size)
    parser = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="tokenrouter-parse")
    tokenizer = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenrouter-tokenize")
    bounds = Bounds.of(svc.runtime.context_limit, svc.tokenizer)
    app = FastAPI(title="TokenRouter", docs_url=None, redoc_url=None, redirect_slashes=False)
    app.state.policies, app.state.pools = policies, (parser, tokenizer)  # (the server shuts the threads down)
    document_bodies(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest})
    app.add_middleware(Guard, max_body_bytes=max_body_bytes, max_in_flight=max_concurrent_requests,
                       failed=lambda path, status: metrics.failed(endpoint_label(path), status))
    if api_key:
        app.add_middleware(ApiKey, key=api_key)

    @app.exception_handler(HttpError)
    async def refused(request: Request, exc: HttpError):
        metrics.failed(endpoint_label(request.url.path), exc.status)
        return error_response(exc.message, exc.status, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException):  # unknown path (404), method (405)
        path = request.url.path
        metrics.failed(endpoint_label(path), exc.status_code)
        hint = f" (the API's path is {path.rstrip('/')}, without the slash)" if path.rstrip("/") in ENDPOINTS else ""
        response = error_response(f"{request.method} {path[:200]}: {exc.detail}{hint}", exc.status_code)
        response.headers.update(exc.headers or {})
        return response

    @app.get("/health")
    async def health():
        error = engine_error(svc)
        if error:
            return JSONResponse({"status": "failed", "error": error}, 503,
                                headers={"Retry-After": str(RETRY_AFTER_FAILED)})
        return {"status": "ok", "models": svc.models}

    @app.get("/v1/models")
    async def models():
        card = {"id": served, "object": "model", "created": 0, "owned_by": "tokenrouter", "models": svc.models,
                "default_policy": svc.config.policy.name, "max_model_len": svc.runtime.context_limit,
                "price_per_hour": svc.prices_per_hour}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus():
        stats = await svc._stats()  # NOTE: on the engine loop already; svc.stats() would wait on itself
        return Response(metrics.render(stats, svc.runtime.subservers), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parsed(request, CompletionRequest)
        return await generate(body, body.prompt, isinstance(body.prompt, str), request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await parsed(request, ChatRequest)
        return await generate(body, [m.model_dump() for m in body.messages], False, request)

    async def parsed(request: Request, model: type[GenerationRequest]) -> GenerationRequest:
        """The body, parsed and validated on the parse pool. NOTE: json.loads and pydantic hold the GIL, but
        only for a body already bounded (4 MiB; then few values): tens of ms, not seconds of the engine's loop."""
        raw = await request.body()
        try:
            return await asyncio.get_running_loop().run_in_executor(parser, parse_body, raw, model, bounds)
        except BadBody as e:
            raise HttpError(400, str(e), e.param) from None

    async def generate(body: GenerationRequest, prompt, raw: bool, request: Request):
        if body.model not in (None, served, *svc.models):
            raise HttpError(404, f"model: unknown model {body.model!r}; this server serves {served!r}", "model",
                            "model_not_found")
        routed = await submit(body, prompt, raw)
        ids = ResponseIds(isinstance(body, ChatRequest), served)
        timeout = capped(body.request_timeout, request_timeout)
        if body.stream:
            return StreamingResponse(sse(routed, ids, request.url.path, timeout), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            out = await until_disconnect(request, routed.drain(), timeout)
        except HttpError as e:
            routed.close(e.message)
            raise
        finally:
            routed.close("cancelled")
        if routed.aborted:
            raise HttpError(503, f"request aborted: {engine_error(svc) or routed.aborted}")
        metrics.finished(request.url.path, out)
        return ids.response(out)

    async def submit(body: GenerationRequest, prompt, raw: bool) -> RoutedRequest:
        error = engine_error(svc)
        if error:
            raise HttpError(503, f"engine failed: {error}")
        try:
            body.check()
            policy = policies.get(body.routing.policy, body.routing.params(svc.config.policy.name))
            sampling = body.sampling()
            limit = svc.runtime.context_limit
            prepare = functools.partial(svc.prepare, prompt, policy, raw=raw, context_limit=limit, **sampling)
            prompt_ids, params, policy = await asyncio.get_running_loop().run_in_executor(tokenizer, prepare)
            if len(prompt_ids) >= limit:
                raise ValueError(f"prompt: {len(prompt_ids)} tokens, {len(prompt_ids) - limit + 1} too many: this "
                                 f"engine's models hold {limit} tokens in all, prompt and output")
            if "max_tokens" not in sampling:  # the engine's default, cut to what the context has left
                params.max_tokens = min(params.max_tokens, limit - len(prompt_ids))
            return RoutedRequest(svc, prompt_ids, params, policy)
        except EngineOverloaded as e:
            raise HttpError(503, str(e), code=OVERLOADED) from None
        except ValueError as e:  # messages start with the field they are about
            raise HttpError(400, redact_paths(str(e)), str(e).partition(":")[0].split(" ")[0]) from None
        except RuntimeError as e:  # the engine failed (EngineFailed)
            raise HttpError(503, f"engine failed: {redact_paths(str(e))}") from None

    async def sse(routed: RoutedRequest, ids: ResponseIds, endpoint: str, timeout: float | None) -> AsyncIterator[str]:
        deadline = asyncio.get_running_loop().time() + timeout if timeout else None
        first = True
        try:
            while not routed.done:
                async with asyncio.timeout_at(deadline):  # NOTE: never around a yield: it would cancel the sender
                    records = await routed.records()
                text = routed.new_text()
                if routed.done and routed.aborted:
                    break
                yield event(ids.chunk(text, records, first, routed.output() if routed.done else None))
                first = False
            if routed.aborted:
                metrics.failed(endpoint, 503)
                yield event(error_json(f"request aborted: {engine_error(svc) or routed.aborted}", 503))
            else:
                metrics.finished(endpoint, routed.output())
        except TimeoutError:
            routed.close(f"timed out after {timeout} s")
            metrics.failed(endpoint, 504)
            yield event(error_json(f"request_timeout: the request ran longer than {timeout} s", 504,
                                   "request_timeout"))
        except Exception as e:  # NOTE: a bug in rendering; this request ends, the engine goes on
            routed.close(f"internal error: {e}")
            metrics.failed(endpoint, 500)
            yield event(error_json(redact_paths(f"internal error: {type(e).__name__}: {e}"), 500))
        finally:
            if not routed.closed and not routed.done:
                metrics.failed(endpoint, 499)
            routed.close("client went away")  # NOTE: a no-op once finished; else abort, blocks freed everywhere
        yield "data: [DONE]\n\n"

    return app


class ApiKey:
    """ASGI middleware: every path but /health needs `Authorization: Bearer <key>` (compared in constant time)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" and \
                not hmac.compare_digest(dict(scope["headers"]).get(b"authorization", b""), self.expected):
            response = error_response("missing or wrong API key (Authorization: Bearer ...)", 401)
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class Disconnected(Exception):
    """The client went away (or its connection missed a deadline) before its body was in."""


class Guard:
    """ASGI middleware: request bodies of at most `max_body_bytes` (413, decided from Content-Length where given,
    else while reading); once a body is in, at most `max_in_flight` requests at once (503, Retry-After), /health
    and /metrics besides; an unhandled exception answered with a 500 (logged; the connection, the engine and
    other requests go on). NOTE: a request takes its slot only after its whole body arrived: a connection that
    trickles its body, or is closed for missing its deadline (`http_server.DeadlineH11`), never holds one."""

    def __init__(self, app, max_body_bytes: int, max_in_flight: int, failed=lambda path, status: None):
        self.app, self.max_body_bytes, self.max_in_flight = app, max_body_bytes, max_in_flight
        self.failed = failed
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            body = await self.read_body(scope, receive)
        except Disconnected:
            return
        if body is None:
            too_large = error_response(f"body: larger than {self.max_body_bytes} bytes", 413, "body")
            return await too_large(scope, receive, send)
        limited = scope["path"] not in UNLIMITED
        if limited and self.in_flight >= self.max_in_flight:
            return await error_response(f"more than {self.max_in_flight} requests in flight; retry later", 503,
                                        code=OVERLOADED)(scope, receive, send)
        self.in_flight += limited
        try:
            await self.answer(scope, replay(body, receive), send)
        finally:
            self.in_flight -= limited

    async def answer(self, scope, receive, send):
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            self.failed(scope.get("path"), 500)
            if not started:
                await error_response(redact_paths(f"internal error: {type(e).__name__}: {e}"), 500)(scope, receive, send)

    async def read_body(self, scope, receive) -> bytes | None:
        """The whole body, or None once it is known to exceed the limit (Disconnected if the client left first)."""
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise Disconnected
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body"):
                break
        return b"".join(chunks)


def replay(body: bytes, receive):
    """An ASGI receive that hands out `body` once, then the connection's own messages (its disconnect)."""
    sent = False

    async def receive_again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


def endpoint_label(path: str) -> str:
    """The metrics label of a request path: the path if it is one of the API's, else "other" (the label set
    stays bounded whatever paths clients send)."""
    return path if path in ENDPOINTS else "other"


def document_bodies(app: FastAPI, bodies: dict) -> None:
    """FastAPI's OpenAPI document, plus the JSON body each path of `bodies` reads itself (off the loop: see
    `parsed`), under the model's name in its components."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = FastAPI.openapi(app)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                doc["paths"][path]["post"]["requestBody"] = {"required": True,
                                                             "content": {"application/json": {"schema": ref}}}
        return app.openapi_schema

    app.openapi = openapi


def error_response(message: str, status: int, param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = {}
    if status == 503:
        headers["Retry-After"] = str(RETRY_AFTER_OVERLOADED if code == OVERLOADED else RETRY_AFTER_FAILED)
    return JSONResponse(error_json(message, status, param, code), status, headers=headers)


def capped(asked: float | None, limit: float | None) -> float | None:
    """A request's own timeout may shorten the server's, never lengthen it."""
    if limit is None or asked is None:
        return asked if limit is None else limit
    return min(asked, limit)


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def engine_error(svc) -> str | None:
    """Why the engine cannot serve (None while healthy)."""
    if svc.closed:
        return "the service is closed"
    error = getattr(svc, "error", None)
    return redact_paths(error) if error else error


async def until_disconnect(request: Request, work, timeout: float | None):
    """Run `work` unless the client disconnects first (HttpError 499) or it outlasts `timeout` (504)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        if gone in done:
            raise HttpError(499, "client went away")
        raise HttpError(504, f"request_timeout: the request ran longer than {timeout} s", "request_timeout")
    finally:
        for t in (task, gone):
            t.cancel()
            with suppress(asyncio.CancelledError):
                await t


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
