"""The OpenAI-compatible HTTP API over one in-process Service. The app runs on the engine's own event loop
(see `http_server.py`), so handlers talk to the runtime directly and every abort lands at a step boundary."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import suppress
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenrouter.engine.runtime import EngineOverloaded
from tokenrouter.service.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from tokenrouter.service.openai_protocol import (ChatRequest, CompletionRequest, GenerationRequest, ResponseIds,
                                                 error_json)
from tokenrouter.service.routed_request import RoutedRequest


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def build_app(svc, api_key: str | None = None, request_timeout: float | None = None,
              model_name: str | None = None) -> FastAPI:
    """`request_timeout`: seconds a request may run unless it asks for its own; None: no limit.
    `model_name`: the id /v1/models lists (default: the config file's stem); requests may name it, one of
    the engine's models, or nothing."""
    served = model_name or Path(svc.config.path).stem or "tokenrouter"
    metrics = ServerMetrics(svc.models)
    app = FastAPI(title="TokenRouter", docs_url=None, redoc_url=None, openapi_url=None)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        error = exc.errors()[0]
        if error["type"] == "json_invalid":
            param, message = "body", f"body: malformed JSON ({error.get('ctx', {}).get('error', error['msg'])})"
        else:
            param = ".".join(str(p) for p in error["loc"] if p != "body") or "body"
            message = f"{param}: {error['msg']}"
        metrics.failed(request.url.path, 400)
        return JSONResponse(error_json(message, 400, param), 400)

    @app.exception_handler(HttpError)
    async def refused(request: Request, exc: HttpError):
        metrics.failed(request.url.path, exc.status)
        return JSONResponse(error_json(exc.message, exc.status, exc.param), exc.status)

    @app.get("/health")
    async def health():
        error = engine_error(svc)
        if error:
            return JSONResponse({"status": "failed", "error": error}, 503)
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
    async def completions(body: CompletionRequest, request: Request):
        return await generate(body, body.prompt, isinstance(body.prompt, str), request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await generate(body, [m.model_dump() for m in body.messages], False, request)

    async def generate(body: GenerationRequest, prompt, raw: bool, request: Request):
        if body.model not in (None, served, *svc.models):
            raise HttpError(404, f"model: unknown model {body.model!r}; this server serves {served!r}", "model")
        routed = submit(body, prompt, raw)
        ids = ResponseIds(isinstance(body, ChatRequest), served)
        timeout = body.request_timeout or request_timeout
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

    def submit(body: GenerationRequest, prompt, raw: bool) -> RoutedRequest:
        error = engine_error(svc)
        if error:
            raise HttpError(503, f"engine failed: {error}")
        try:
            prompt_ids, params, policy = svc.prepare(prompt, body.routing.policy, raw=raw, **body.sampling(),
                                                     **body.routing.params())
            limit = svc.runtime.context_limit
            if len(prompt_ids) >= limit:
                raise ValueError(f"prompt: {len(prompt_ids)} tokens, but this engine's models hold {limit} tokens "
                                 "in all, prompt and output")
            return RoutedRequest(svc, prompt_ids, params, policy)
        except EngineOverloaded as e:
            raise HttpError(503, str(e)) from None
        except ValueError as e:  # messages start with the field they are about
            raise HttpError(400, str(e), str(e).partition(":")[0].split(" ")[0]) from None
        except RuntimeError as e:  # the engine failed (EngineFailed)
            raise HttpError(503, f"engine failed: {e}") from None

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
        finally:
            if not routed.closed and not routed.done:
                metrics.failed(endpoint, 499)
            routed.close("client went away")  # NOTE: a no-op once finished; else abort, blocks freed everywhere
        yield "data: [DONE]\n\n"

    return app


class ApiKey:
    """ASGI middleware: every path but /health needs `Authorization: Bearer <key>`."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" and \
                dict(scope["headers"]).get(b"authorization") != self.expected:
            response = JSONResponse(error_json("missing or wrong API key (Authorization: Bearer ...)", 401), 401)
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def engine_error(svc) -> str | None:
    """Why the engine cannot serve (None while healthy)."""
    if svc.closed:
        return "the service is closed"
    return getattr(svc, "error", None)


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
