"""One streamed request as the app sees it: the token records so far, the live metrics they give, and the
cost once the engine reports the finished request."""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from tokenrouter.engine.sequence import TokenRecord
from tokenrouter.policies import Policy
from tokenrouter.service.output import RequestMetrics, RoutedOutput


class LiveRequest:
    def __init__(self, models: list[str], policy: Policy):
        self.models, self.policy = models, policy
        self.home = policy.home(models)
        self.records: list[TokenRecord] = []
        self.started = time.perf_counter()
        self.ended: float | None = None
        self.output: RoutedOutput | None = None
        self.cost: float | None = None
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
                "finish": self.output.finish_reason if self.output else self._unfinished()}

    def _unfinished(self) -> str:
        return "stopped" if self.stopped else "error" if self.error else "running"

    def provenance(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.records]
