"""Prometheus text for /metrics: request and token counters kept by the server, engine state read from the
service's stats, and per-model step latency histograms folded from the subservers' recent steps."""
from __future__ import annotations

from collections import Counter

from tokenrouter.service.output import RoutedOutput

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
    "tokens": ("model_forward_tokens_total", "counter", "tokens run forward, prompts and catch-ups included"),
    "preemptions": ("preemptions_total", "counter", "sequences preempted for blocks"),
    "tau": ("delay_tau_seconds", "gauge", "delayed-batching wait bound"),
}


class StepHistogram:
    """Cumulative histogram of one subserver's step seconds. Steps are folded in on each scrape from the
    subserver's window of recent steps; those that left the window unread count in `_count` only."""

    def __init__(self):
        self.buckets = [0] * len(STEP_BUCKETS)
        self.sum = 0.0
        self.count = 0

    def fold(self, steps: int, recent) -> None:
        new = steps - self.count
        for seconds in list(recent)[-new:] if new > 0 else []:
            self.sum += seconds
            for i, bound in enumerate(STEP_BUCKETS):
                if seconds <= bound:
                    self.buckets[i] += 1
        self.count = max(self.count, steps)


class ServerMetrics:
    def __init__(self, models: list[str]):
        self.models = models
        self.requests: Counter[tuple[str, str]] = Counter()  # (endpoint, outcome) -> requests
        self.tokens: Counter[str] = Counter({m: 0 for m in models})  # output tokens written per model
        self.handoffs = 0
        self.steps = {m: StepHistogram() for m in models}

    def finished(self, endpoint: str, out: RoutedOutput) -> None:
        self.requests[endpoint, out.finish_reason] += 1
        self.tokens.update(out.metrics.tokens_per_model)
        self.handoffs += out.metrics.handoffs

    def failed(self, endpoint: str, status: int) -> None:
        self.requests[endpoint, str(status)] += 1

    def render(self, stats: dict, subservers: dict) -> str:
        """`stats` is `Service.stats()`; `subservers` the runtime's, for their step latencies."""
        lines: list[str] = []
        metric(lines, "requests_total", "counter", "HTTP generation requests by endpoint and outcome "
               "(finish reason or HTTP status)",
               {f'endpoint="{e}",outcome="{o}"': n for (e, o), n in sorted(self.requests.items())})
        metric(lines, "output_tokens_total", "counter", "output tokens of finished requests, by the model that wrote them",
               {f'model="{m}"': n for m, n in self.tokens.items()})
        metric(lines, "handoffs_total", "counter", "hand-offs to another model", {"": self.handoffs})
        metric(lines, "active_requests", "gauge", "requests in the engine", {"": stats["active_requests"]})
        for key, (name, kind, help_text) in PER_MODEL.items():
            metric(lines, name, kind, help_text, {f'model="{m}"': stats[m][key] for m in self.models})
        lines += [f"# HELP {PREFIX}step_seconds model step latency", f"# TYPE {PREFIX}step_seconds histogram"]
        for m in self.models:
            h = self.steps[m]
            h.fold(subservers[m].stats.steps, subservers[m].stats.step_seconds)
            for bound, n in zip(STEP_BUCKETS, h.buckets):
                lines.append(f'{PREFIX}step_seconds_bucket{{model="{m}",le="{bound}"}} {n}')
            lines += [f'{PREFIX}step_seconds_bucket{{model="{m}",le="+Inf"}} {h.count}',
                      f'{PREFIX}step_seconds_sum{{model="{m}"}} {h.sum}',
                      f'{PREFIX}step_seconds_count{{model="{m}"}} {h.count}']
        return "\n".join(lines) + "\n"


def metric(lines: list[str], name: str, kind: str, help_text: str, samples: dict[str, float]) -> None:
    lines += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]
    lines += [f"{PREFIX}{name}{{{labels}}} {value}" if labels else f"{PREFIX}{name} {value}"
              for labels, value in samples.items()]


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
        out[m].update({key: int(v) for key, v in out[m].items() if key not in ("busy_seconds", "tau")})
    out["active_requests"] = int(values[f"{PREFIX}active_requests"])
    return out
