"""One streamed request as the app sees it: the token records so far, the live metrics they give, and the
cost once the engine reports the finished request (estimated from the records for a stopped one)."""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from app.pricing import estimated_dollars
from tokenrouter.engine.sequence import TokenRecord
from tokenrouter.policies import Policy
from tokenrouter.service.output import RequestMetrics, RoutedOutput


class LiveRequest:
    def __init__(self, models: list[str], policy: Policy, prompt_tokens: int = 0, spec: str = ""):
        self.models, self.policy, self.prompt_tokens = models, policy, prompt_tokens
        self.spec = spec or policy.describe()
        self.home = policy.home(models)
        self.records: list[TokenRecord] = []
        self.started = time.perf_counter()
        self.ended: float | None = None
        self.output: RoutedOutput | None = None
        self.cost: float | None = None
        self.cost_estimated = False
        self.error = ""
        self.stopped = False

    def add(self, record: TokenRecord) -> None:
        self.records.append(record)

    def finish(self, output: RoutedOutput | None, cost: float | None) -> None:
        self.ended = time.perf_counter()
        self.output, self.cost = output, cost

    def fail(self, message: str) -> None:
        self.ended = time.perf_counter()
        self.error = message

    def stop(self) -> None:
        """The reader pressed Stop: the stream is left (which aborts the request in the engine and frees
        its blocks in every model); a request that already ended stays as it ended."""
        if self.ended is None:
            self.ended = time.perf_counter()
            self.stopped = True

    def price_stopped(self, service) -> None:
        """A stopped request's cost so far, estimated from its records (the engine reports no output for it)."""
        if self.stopped and self.cost is None:
            self.cost = estimated_dollars(self.records, self.models, self.home, self.prompt_tokens, service)
            self.cost_estimated = self.cost is not None

    @property
    def running(self) -> bool:
        return self.ended is None

    @property
    def elapsed(self) -> float:
        return (self.ended or time.perf_counter()) - self.started

    @property
    def handoffs(self) -> int:
        """Hand-offs so far (exact once finished): under a token-level policy every token a model other
        than the home wrote was one send; a policy that moves the home hands off once, for good."""
        if self.output is not None:
            return self.output.metrics.handoffs
        away = sum(r.model != self.home for r in self.records)
        return min(away, 1) if getattr(self.policy, "moves_home", False) else away

    def metrics(self) -> RequestMetrics:
        return RequestMetrics.from_records(self.records, self.models, self.handoffs, {}, self.elapsed)

    def summary(self) -> dict[str, Any]:
        """The numbers the app shows: tokens/s over the request so far (time to first token included),
        TTFT, large-model share, hand-offs, latency, and cost once known."""
        m = self.metrics()
        n = len(self.records)
        return {"tokens": n, "tokens_per_s": n / self.elapsed if self.elapsed > 0 else 0.0,
                "ttft_ms": m.ttft * 1e3, "large_share": m.large_share, "handoffs": self.handoffs,
                "latency_s": self.elapsed, "tokens_per_model": m.tokens_per_model, "cost": self.cost,
                "cost_estimated": self.cost_estimated,
                "finish": self.output.finish_reason if self.output else self._unfinished()}

    def _unfinished(self) -> str:
        return "stopped" if self.stopped else "error" if self.error else "running"

    def provenance(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.records]
