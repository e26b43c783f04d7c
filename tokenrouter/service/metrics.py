"""/metrics through `prometheus_client`, on a registry of the server's own (so several servers in one
process keep apart): request, token and hand-off counters kept by the server, a histogram of each model's
step seconds, and the engine's state (KV blocks, queues, steps, busy seconds) read from `Service.stats()`
at every scrape."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenrouter.service.output import RoutedOutput

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics", "parse", "stats_from_text"]

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PREFIX = "tokenrouter_"
PER_MODEL = {  # Service.stats() key -> (metric, type, help)
    "free_blocks": ("kv_blocks_free", "gauge", "free KV cache blocks"),
    "total_blocks": ("kv_blocks_total", "gauge", "KV cache blocks"),
    "waiting": ("queue_waiting", "gauge", "sequences waiting at the model"),
    "running": ("queue_running", "gauge", "sequences in the model's running batch"),
    "parked": ("queue_parked", "gauge", "sequences parked at the model while another writes their token"),
    "steps": ("model_steps_total", "counter", "model steps run"),
    "busy_seconds": ("model_busy_seconds_total", "counter", "seconds spent in model steps"),
    "forward_seconds": ("model_forward_seconds_total", "counter", "of the step seconds, the forward pass and logits"),
    "driver_seconds": ("driver_seconds_total", "counter", "seconds the driver spent scheduling and processing steps"),
    "tokens": ("model_forward_tokens_total", "counter", "tokens run forward, prompts and catch-ups included"),
    "preemptions": ("preemptions_total", "counter", "sequences preempted for blocks"),
    "tau": ("delay_tau_seconds", "gauge", "delayed-batching wait bound"),
}
FLOATS = ("busy_seconds", "forward_seconds", "driver_seconds", "tau")


class EngineState:
    """A collector of the engine's state as of the scrape's `Service.stats()`."""

    def __init__(self, models: list[str]):
        self.models = models
        self.stats: dict | None = None

    def collect(self):
        if self.stats is None:
            return
        yield GaugeMetricFamily(f"{PREFIX}active_requests", "requests in the engine", value=self.stats["active_requests"])
        for key, (name, kind, help_text) in PER_MODEL.items():
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(PREFIX + name, help_text,
                                                                                     labels=["model"])
            for m in self.models:
                family.add_metric([m], self.stats[m][key])
            yield family


class ServerMetrics:
    def __init__(self, models: list[str]):
        self.models = models
        self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}requests", "HTTP generation requests by endpoint and outcome (finish "
                                "reason or HTTP status)", ["endpoint", "outcome"], registry=self.registry)
        self.tokens = Counter(f"{PREFIX}output_tokens", "output tokens of finished requests, by the model that "
                              "wrote them", ["model"], registry=self.registry)
        self.handoffs = Counter(f"{PREFIX}handoffs", "hand-offs to another model", registry=self.registry)
        self.drafts = Counter(f"{PREFIX}draft_tokens", "verification: drafts the verifier judged, by outcome "
                              "(accepted, rolled_back)", ["outcome"], registry=self.registry)
        for outcome in ("accepted", "rolled_back"):
            self.drafts.labels(outcome=outcome)
        self.steps = Histogram(f"{PREFIX}step_seconds", "model step latency", ["model"], buckets=STEP_BUCKETS,
                               registry=self.registry)
        self.steps_read = {m: 0 for m in models}
        for m in models:  # every model's series from the first scrape on, at zero
            self.tokens.labels(model=m)
            self.steps.labels(model=m)
        self.engine = EngineState(models)
        self.registry.register(self.engine)

    def finished(self, endpoint: str, out: RoutedOutput) -> None:
        self.requests.labels(endpoint=endpoint, outcome=out.finish_reason).inc()
        for m, n in out.metrics.tokens_per_model.items():
            self.tokens.labels(model=m).inc(n)
        self.handoffs.inc(out.metrics.handoffs)
        self.drafts.labels(outcome="accepted").inc(out.metrics.accepted)
        self.drafts.labels(outcome="rolled_back").inc(out.metrics.rolled_back)

    def failed(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, outcome=str(status)).inc()

    def render(self, stats: dict, subservers: dict) -> bytes:
        """The exposition text (served as CONTENT_TYPE_LATEST). `stats` is `Service.stats()`; `subservers`
        the runtime's, whose windows of recent step seconds are folded into the histogram.
        NOTE: a step that left a subserver's window (its last STATS_WINDOW steps) before any scrape read it
        is missing from the histogram; `model_steps_total` counts every step."""
        for m in self.models:
            done, recent = subservers[m].stats.steps, list(subservers[m].stats.step_seconds)
            new = min(done - self.steps_read[m], len(recent))
            for seconds in recent[len(recent) - new:] if new > 0 else []:
                self.steps.labels(model=m).observe(seconds)
            self.steps_read[m] = max(self.steps_read[m], done)
        self.engine.stats = stats
        return generate_latest(self.registry)


def parse(text: str) -> dict[str, float]:
    """Prometheus text back to {"name{labels}": value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def stats_from_text(text: str, models: list[str]) -> dict:
    """The `Service.stats()` dict from /metrics text (what a remote client's `stats()` returns)."""
    values = parse(text)
    out: dict = {}
    for m in models:
        out[m] = {key: values[f'{PREFIX}{name}{{model="{m}"}}'] for key, (name, _, _) in PER_MODEL.items()}
        out[m].update({key: int(v) for key, v in out[m].items() if key not in FLOATS})
    out["active_requests"] = int(values[f"{PREFIX}active_requests"])
    return out
