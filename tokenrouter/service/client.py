"""`tokenrouter.connect(url)`: a running server behind the in-process Service's interface (generate,
agenerate, stream, generate_batch, stats, models, close), so notebooks and the app work the same on either.

Prompts map onto the API as the in-process service reads them: a string is one user chat message
(/v1/chat/completions), chat messages likewise, token ids or `raw=True` strings go to /v1/completions.
Policies are names or specs ("confidence", "schedule:every=3") plus keyword parameters."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tokenrouter.engine.runtime import EngineFailed, EngineOverloaded
from tokenrouter.engine.sequence import TokenRecord
from tokenrouter.service.metrics import stats_from_text
from tokenrouter.service.openai_protocol import OVERLOADED, SAMPLING, error_status, parse_record, routed_output
from tokenrouter.service.output import RequestMetrics, RoutedOutput, RoutedStream


def connect(url: str, api_key: str | None = None, timeout: float | None = None) -> RemoteService:
    """A client of the server at `url`; `timeout`: seconds to wait for one response (None: no limit)."""
    return RemoteService(url, api_key, timeout)


class RemoteService:
    def __init__(self, url: str, api_key: str | None = None, timeout: float | None = None):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout, connect=10.0)
        self._http = httpx.Client(base_url=self.url, headers=self.headers, timeout=self._timeout)
        card = self._get("/v1/models")["data"][0]
        self.model_name: str = card["id"]
        self.models: list[str] = card["models"]
        self.prices_per_hour: dict[str, float] = card.get("price_per_hour", {})
        self.closed = False

    # ---- requests --------------------------------------------------------------------------------
    def generate(self, prompt: str | list, policy: str | None = None, **kwargs: Any) -> RoutedOutput:
        path, body = self.build_request(prompt, policy, **kwargs)
        return _output(raise_for_error(self._http.post(path, json=body)).json())

    async def agenerate(self, prompt: str | list, policy: str | None = None, **kwargs: Any) -> RoutedOutput:
        path, body = self.build_request(prompt, policy, **kwargs)
        async with self._async_client() as http:
            return _output(raise_for_error(await http.post(path, json=body)).json())

    def stream(self, prompt: str | list, policy: str | None = None, **kwargs: Any) -> RoutedStream:
        """Token records as the server streams them (`async for`); once exhausted, `.output` is the
        RoutedOutput. Leaving the loop early closes the connection, which aborts the request."""
        path, body = self.build_request(prompt, policy, **kwargs)
        return RoutedStream(self._stream(path, {**body, "stream": True}))

    async def _stream(self, path: str, body: dict) -> AsyncIterator[TokenRecord | RoutedOutput]:
        async with self._async_client() as http, http.stream("POST", path, json=body) as response:
            async for item in read_stream(response):
                yield item

    def generate_batch(self, requests: list, concurrency: int = 8, **common: Any) -> list[RoutedOutput]:
        """Many requests, at most `concurrency` in flight, outputs in request order; a request the server
        refused (bad request, overload, failure) comes back with `finish_reason == "error"` and `.error`."""
        if concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
        calls = [{**common, **r} if isinstance(r, dict) else {**common, "prompt": r} for r in requests]

        def one(args: dict) -> RoutedOutput:
            try:
                return self.generate(**args)
            except (ValueError, RuntimeError, TimeoutError) as e:
                metrics = RequestMetrics.from_records([], self.models, 0, {}, 0.0)
                return RoutedOutput("", [], "error", 0, str(args.get("policy")), self.models, metrics, str(e))

        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(one, calls))

    def build_request(self, prompt: str | list, policy: str | None = None, raw: bool = False,
                      request_timeout: float | None = None, **kwargs: Any) -> tuple[str, dict]:
        """The path and JSON body of one generate() call."""
        if policy is not None and not isinstance(policy, str):
            raise TypeError("policy: a remote service takes a policy name or spec such as "
                            f"'confidence:threshold=0.9', not {type(policy).__name__}")
        body: dict[str, Any] = {"model": self.model_name, **{k: kwargs.pop(k) for k in SAMPLING if k in kwargs}}
        for key in ("stop", "stop_token_ids"):
            if isinstance(body.get(key), tuple):
                body[key] = list(body[key])
        body["routing"] = {"policy": policy, **kwargs} if policy is not None else kwargs
        if request_timeout is not None:
            body["request_timeout"] = request_timeout
        if isinstance(prompt, str) and not raw:
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            return "/v1/chat/completions", {**body, "messages": prompt}
        return "/v1/completions", {**body, "prompt": prompt}

    # ---- state -----------------------------------------------------------------------------------
    @property
    def error(self) -> str | None:
        """None while the server's engine is healthy, else why it failed."""
        response = self._http.get("/health")
        return None if response.status_code == 200 else response.json().get("error", response.text)

    def stats(self) -> dict:
        """The server engine's `Service.stats()`, read from /metrics."""
        return stats_from_text(raise_for_error(self._http.get("/metrics")).text, self.models)

    def _get(self, path: str) -> dict:
        return raise_for_error(self._http.get(path)).json()

    def _async_client(self) -> httpx.AsyncClient:
        # NOTE: one per call: an AsyncClient belongs to the event loop it was used on, and callers come
        # from several (a notebook kernel's, Gradio's, asyncio.run in scripts).
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=self._timeout)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._http.close()

    def __enter__(self) -> RemoteService:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteService({self.url}, models={self.models})"


async def read_stream(response: httpx.Response) -> AsyncIterator[TokenRecord | RoutedOutput]:
    """A streamed response's token records as they arrive, then its RoutedOutput."""
    if response.status_code != 200:
        await response.aread()
        raise_for_error(response)
    records, text = [], []
    async for payload in sse_payloads(response.aiter_lines()):
        if "error" in payload:
            code = payload["error"].get("code")
            raise _error(error_status(code), payload["error"]["message"], code)
        choice = payload["choices"][0]
        text.append((choice["delta"].get("content") or "") if "delta" in choice else choice["text"])
        for r in map(parse_record, choice["provenance"]):
            records.append(r)
            yield r
        if choice["finish_reason"] is not None:
            yield routed_output("".join(text), records, choice["finish_reason"], payload["usage"], payload["routing"])


async def sse_payloads(lines: AsyncIterator[str]) -> AsyncIterator[dict]:
    """The JSON payloads of a server-sent event stream, up to `data: [DONE]`."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _output(body: dict) -> RoutedOutput:
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return routed_output(text, [parse_record(r) for r in choice["provenance"]], choice["finish_reason"],
                         body["usage"], body["routing"])


def raise_for_error(response: httpx.Response) -> httpx.Response:
    """The server's errors as the in-process service raises them (ValueError for a bad request, ...)."""
    if response.status_code < 400:
        return response
    try:
        error = response.json()["error"]
        message, code = error["message"], error.get("code")
    except (ValueError, KeyError, TypeError):
        message, code = response.text, None
    raise _error(response.status_code, message, code)


def _error(status: int, message: str, code: str | None = None) -> Exception:
    if status in (400, 404, 413):
        return ValueError(message)
    if status == 401:
        return PermissionError(message)
    if status == 504:
        return TimeoutError(message)
    if status == 503:
        return EngineOverloaded(message) if code == OVERLOADED else EngineFailed(message)
    return RuntimeError(f"HTTP {status}: {message}")
