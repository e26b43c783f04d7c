"""The engine as a background service: its own event loop on a daemon thread, usable from scripts,
notebooks (inside a running kernel loop) and other event loops alike."""
from __future__ import annotations

import asyncio
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from tokenrouter.config import EngineConfig, load_config
from tokenrouter.engine.clock import VirtualLoop, now
from tokenrouter.engine.placement import close_all, start_executors
from tokenrouter.engine.runtime import Runtime
from tokenrouter.engine.sequence import SamplingParams, Sequence, TokenRecord
from tokenrouter.engine.throughput_model import Prediction, profiled_model, verify_inputs
from tokenrouter.models import native
from tokenrouter.models.prepare import QUANTIZED
from tokenrouter.models.sources import resolve_model_dir
from tokenrouter.policies import Policy, make_policy, split_policy
from tokenrouter.service.encoding import encode_prompt
from tokenrouter.service.output import RequestMetrics, RoutedOutput, RoutedStream

MAX_POLICIES = 64  # policy objects kept for reuse (equal specs share one, so their rows are scored together)
SAMPLING_FIELDS = {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos"}


def serve(config_path: str | Path, *, announce: bool = True, **overrides: Any) -> Service:
    """Load the models of a config and start the engine on a background thread; its ready line (each model's dtype,
    kernels and memory) goes to stderr, as a start's steps do (`announce=False`: the caller prints its own, with
    its URL)."""
    from tokenrouter.bench.progress import ready_line

    service = Service(load_config(config_path, **overrides))
    if announce:
        print(ready_line(service), file=sys.stderr, flush=True)
    return service


class Service:
    def __init__(self, config: EngineConfig, *, executors: dict | None = None, tokenizer=None,
                 loop: asyncio.AbstractEventLoop | None = None, throughput_model=None):
        """The config's models, loaded and started. A simulation (tokenrouter/simulate) brings its own
        `executors` (simulated workers), `tokenizer`, `loop` (on virtual time) and `throughput_model` instead."""
        self.config = config
        self.models = [m.name for m in config.models]
        dirs: dict[str, Path] = {}
        if executors is None:
            from transformers import AutoTokenizer

            if any(m.device == "cpu" and m.dtype in ("auto", *QUANTIZED) for m in config.models):
                native.build_in_background()  # NOTE: compiled while the models convert and load, not after
            dirs = {m.name: resolve_model_dir(m.source) for m in config.models}
            tokenizer = AutoTokenizer.from_pretrained(dirs[self.models[0]])
            _check_same_tokenizer(tokenizer, dirs)
            executors = start_executors(config, dirs)
        self.tokenizer, self.executors = tokenizer, executors
        self._policies: dict[tuple, Policy] = {}
        self.loop = loop or asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="tokenrouter-engine", daemon=True)
        self._thread.start()
        self.closed = False
        try:
            self.runtime = self._on_loop(self._start())
            if throughput_model is None and dirs and len(self.models) > 1:
                throughput_model = profiled_model(config, self.executors, dirs)
            self.throughput_model = throughput_model
        except BaseException:
            self.close()
            raise
        self.runtime.throughput_model = self.throughput_model
        tau_ms = config.scheduler.delay_tau_ms
        if tau_ms >= 0:
            self.set_tau(tau_ms / 1e3)

    def set_tau(self, seconds: float | None) -> None:
        """Fix the large models' delayed-batching threshold (None: let the throughput model choose)."""
        self.runtime.fixed_tau = seconds
        for name in self.models[1:]:
            self.runtime.subservers[name].tau = seconds or 0.0

    def predict(self, concurrency: int, large_share: float, tau: float | None = None,
                catch_up: float | None = None, home_steps: float = 1.0, verify: bool = False) -> Prediction:
        """The throughput model's prediction; with tau None, at the tau it would choose. `catch_up`: tokens the
        large model computes per hand-off (default 1 / large_share); `home_steps`: home steps per output token;
        `verify`: the large model judges what it catches up on."""
        if self.throughput_model is None:
            raise ValueError("predict: the throughput model needs at least two models")
        if tau is None:
            return self.throughput_model.choose_tau(concurrency, large_share, self.runtime.max_tpot, catch_up,
                                                    home_steps, verify)
        return self.throughput_model.predict(concurrency, large_share, tau, catch_up, home_steps, verify)

    def predict_verify(self, concurrency: int, acceptance: float, drafts: float, tau: float | None = None,
                       route_step: bool = False) -> Prediction:
        """The prediction for a verifying policy: `acceptance` per judged draft, `drafts` judged per visit to the
        large model (k for verify:every=k), `route_step` for verify:of (engine/throughput_model.py)."""
        return self.predict(concurrency, tau=tau, **verify_inputs(acceptance, drafts, route_step))

    async def _start(self) -> Runtime:
        runtime = Runtime(self.config, self.executors, self.tokenizer)
        runtime.start()
        return runtime

    def clock(self) -> float:
        """Seconds on the engine's clock (virtual in a simulation), for timing a run from outside the loop."""
        return self.loop.time() if isinstance(self.loop, VirtualLoop) else time.perf_counter()

    def _on_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _await_on_loop(self, coro):
        if asyncio.get_running_loop() is self.loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    # ---- requests --------------------------------------------------------------------------------
    def policy(self, policy: str | Policy | None = None, **params: Any) -> Policy:
        """A policy object by name ("confidence", "random:share=0.2") or the config's default; equal specs
        share one object so a batch of their sequences is scored at once."""
        if isinstance(policy, Policy):
            return policy
        if policy is None:
            policy, params = self.config.policy.name, {**self.config.policy.params, **params}
        name, parsed = split_policy(policy)
        params = {**parsed, **params}
        key = (name, tuple(sorted(params.items())))
        if key not in self._policies:
            self._policies[key] = make_policy(name, **params)
            while len(self._policies) > MAX_POLICIES:  # a long-running server sees unbounded parameter sets
                self._policies.pop(next(iter(self._policies)))
        return self._policies[key]

    def prepare(self, prompt: str | list, policy=None, raw: bool = False, context_limit: int | None = None,
                **kwargs: Any):
        """Validate one request: token ids, sampling parameters and policy (raises ValueError naming the field).
        With `context_limit`, a text prompt is tokenized only until it is known to exceed it (`encode_within`)."""
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in SAMPLING_FIELDS}
        if sampling.get("seed") is None and sampling.get("temperature", 0) > 0:
            sampling["seed"] = random.getrandbits(31)
        params = SamplingParams(**sampling)
        return self.encode(prompt, raw, context_limit), params, self.policy(policy, **kwargs)

    def encode(self, prompt: str | list, raw: bool = False, limit: int | None = None) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, raw, limit)

    def generate(self, prompt: str | list, policy: str | Policy | None = None, **kwargs: Any) -> RoutedOutput:
        """Routed generation of one prompt (a string, chat messages or token ids); blocks until done."""
        request = self.prepare(prompt, policy, **kwargs)
        return self._on_loop(self._generate(*request))

    async def agenerate(self, prompt: str | list, policy: str | Policy | None = None, **kwargs: Any) -> RoutedOutput:
        request = self.prepare(prompt, policy, **kwargs)
        return await self._await_on_loop(self._generate(*request))

    def generate_batch(self, requests: list, concurrency: int = 8, on_output: Callable | None = None,
                       **common: Any) -> list[RoutedOutput]:
        """Many requests, at most `concurrency` in flight; each request is a prompt or a dict of
        generate() arguments. Outputs come back in request order; a request the engine refused
        (overload) comes back with `finish_reason == "error"` and the reason in `.error`. `on_output(out)`,
        if given, is called as each request ends (on the engine's thread: keep it short, e.g. a progress bar)."""
        if concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
        prepared = []
        for r in requests:
            args = {**common, **r} if isinstance(r, dict) else {**common, "prompt": r}
            prepared.append(self.prepare(args.pop("prompt"), args.pop("policy", None), **args))
        return self._on_loop(self._generate_many(prepared, concurrency, on_output))

    async def _generate_many(self, prepared: list, concurrency: int, on_output: Callable | None = None):
        gate = asyncio.Semaphore(concurrency)

        async def one(request):
            async with gate:
                try:
                    out = await self._generate(*request)
                except (ValueError, RuntimeError) as e:  # refused (overload, limits): counted, not raised
                    out = self._failed(request, e)
            if on_output is not None:
                on_output(out)
            return out

        return await asyncio.gather(*(one(r) for r in prepared))

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, policy: Policy) -> RoutedOutput:
        seq = self.runtime.submit(prompt_ids, params, policy, stream=False)
        try:  # NOTE: the end, not the stream: a reader woken for every token costs the loop a task switch per token
            await seq.ended.wait()
        except BaseException:  # cancelled: abort; its blocks are freed at the next step boundary
            self.runtime.abort(seq, "cancelled")
            raise
        return self._output(seq)

    def _failed(self, request, error: Exception) -> RoutedOutput:
        prompt_ids, _, policy = request
        metrics = RequestMetrics.from_records([], self.models, 0, {}, 0.0)
        return RoutedOutput("", [], "error", len(prompt_ids), policy.describe(), self.models, metrics, str(error))

    def stream(self, prompt: str | list, policy: str | Policy | None = None, **kwargs: Any) -> RoutedStream:
        """Token records as they become final (`async for`); once exhausted, `.output` is the RoutedOutput.
        Leaving the loop early aborts the request."""
        return RoutedStream(self._stream(prompt, policy, **kwargs))

    async def _stream(self, prompt, policy, **kwargs) -> AsyncIterator[TokenRecord | RoutedOutput]:
        request = self.prepare(prompt, policy, **kwargs)
        seq = await self._await_on_loop(self._submit(*request))
        try:
            while (record := await self._await_on_loop(seq.stream.get())) is not None:
                yield record
            yield await self._await_on_loop(self._routed_output(seq))
        finally:  # left early: abort
            if not seq.finished:
                self.loop.call_soon_threadsafe(self.runtime.abort, seq, "client went away")

    async def _routed_output(self, seq: Sequence) -> RoutedOutput:
        return self._output(seq)

    async def _submit(self, prompt_ids, params, policy) -> Sequence:
        return self.runtime.submit(prompt_ids, params, policy)

    def _output(self, seq: Sequence) -> RoutedOutput:
        text = seq.text
        e2e = now() - seq.arrival
        metrics = RequestMetrics.from_records(seq.records, self.models, seq.handoffs, seq.tokens_computed, e2e,
                                              seq.discarded, seq.drafted, seq.accepted)
        return RoutedOutput(text, list(seq.records), str(seq.finish_reason), seq.num_prompt_tokens,
                            seq.policy.describe(), self.models, metrics)

    # ---- state -----------------------------------------------------------------------------------
    @property
    def prices_per_hour(self) -> dict[str, float]:
        """Each model's `price_per_hour` from the config (what the cost model charges for its busy time)."""
        return {m.name: m.price_per_hour for m in self.config.models}

    @property
    def error(self) -> str | None:
        """None while the engine is healthy; after a model step failed, why (requests then fail fast)."""
        return self.runtime.error

    def stats(self) -> dict:
        """Per model: KV blocks free / total, queue depths, steps run, busy seconds, preemptions."""
        return self._on_loop(self._stats())

    async def _stats(self) -> dict:
        out = {}
        for name, sub in self.runtime.subservers.items():
            s = sub.scheduler
            out[name] = {"free_blocks": sub.blocks.num_free_blocks, "total_blocks": sub.blocks.num_blocks,
                         "waiting": len(s.waiting), "running": len(s.running), "parked": len(s.parked),
                         "steps": sub.stats.steps, "busy_seconds": sub.stats.busy_seconds,
                         "forward_seconds": sub.stats.forward_seconds, "driver_seconds": sub.stats.driver_seconds,
                         "tokens": sub.stats.tokens, "preemptions": s.num_preemptions, "tau": sub.tau}
        out["active_requests"] = len(self.runtime.active)
        return out

    def launch_app(self, **kwargs: Any):
        """The Gradio app on this engine (inline in a notebook); keyword arguments go to `app.launch`."""
        from app import launch

        return launch(self, **kwargs)

    def serve_http(self, port: int = 30000, host: str = "127.0.0.1", **options: Any):
        """Serve this engine over the OpenAI-compatible HTTP API (docs/server.md) from its own loop; returns
        at once with an HttpServer (`.url`, `.stop()`). Port 0: any free port."""
        from tokenrouter.service.http_server import start_http

        return start_http(self, host, port, **options)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if hasattr(self, "runtime"):
            self._on_loop(self._close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()  # its selector and self-pipe (a notebook or a simulation opens many services)
        close_all(self.executors)  # every worker thread, process and actor

    async def _close(self) -> None:
        self.runtime.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_same_tokenizer(tokenizer, dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    vocab = tokenizer.get_vocab()
    for name, path in list(dirs.items())[1:]:
        if AutoTokenizer.from_pretrained(path).get_vocab() != vocab:
            raise ValueError(f"models: {name!r} uses a different tokenizer from {next(iter(dirs))!r}; "
                             "token-level routing needs one vocabulary")
