"""Cost in dollars from model busy time and each model's `price_per_hour`, per request and per completed
task, and the average parameters activated per output token.

Attribution of one request: a model's busy seconds are spread over the tokens it ran forward (prompt,
catch-up and decode tokens alike), so the request pays `tokens_computed[m] x busy_seconds[m] / tokens[m]`
of model m's time, at `price_per_hour[m] / 3600` dollars a second. A request that waited in a batch pays
only for its rows, never for the wait. Run-level cost needs no attribution: the busy time of every model
during the run, priced, divided by the tasks that were completed (a failed task adds cost, not quality)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from tokenrouter.service.output import RoutedOutput


@dataclass(slots=True)
class ModelUsage:
    """One model's cumulative work, as `Service.stats()` reports it."""
    busy_seconds: float
    tokens: int

    @property
    def seconds_per_token(self) -> float:
        return self.busy_seconds / self.tokens if self.tokens else 0.0


def usage(service) -> dict[str, ModelUsage]:
    stats = service.stats()
    return {m: ModelUsage(stats[m]["busy_seconds"], stats[m]["tokens"]) for m in service.models}


def prices(service) -> dict[str, float]:
    """Dollars per second of each model's busy time (an in-process Service or a `tokenrouter.connect` client)."""
    return {m: price / 3600 for m, price in service.prices_per_hour.items()}


def parameters(service) -> dict[str, int]:
    return {m: sub.executor.info.num_parameters for m, sub in service.runtime.subservers.items()}


def request_cost(output: RoutedOutput, service, used: dict[str, ModelUsage] | None = None) -> float:
    """Dollars one request cost (see the module docstring for the attribution). `used` defaults to the
    service's statistics now; pass one snapshot to price many outputs consistently."""
    used = usage(service) if used is None else used
    return attributed_cost(output, used, prices(service))


def attributed_cost(output: RoutedOutput, used: dict[str, ModelUsage], per_second: dict[str, float]) -> float:
    return sum(n * used[m].seconds_per_token * per_second[m] for m, n in output.metrics.tokens_computed.items())


@dataclass(slots=True)
class RunCost:
    busy_seconds: dict[str, float]  # per model, during the run
    dollars: float
    completed: int

    @property
    def per_completed_task(self) -> float:
        """Dollars per completed task; infinite when nothing was completed but something ran."""
        if self.completed:
            return self.dollars / self.completed
        return math.inf if self.dollars > 0 else 0.0


def between(before: dict[str, ModelUsage], after: dict[str, ModelUsage]) -> dict[str, ModelUsage]:
    """The work done between two `usage()` snapshots."""
    return {m: ModelUsage(after[m].busy_seconds - before[m].busy_seconds, after[m].tokens - before[m].tokens)
            for m in after}


def run_cost(before: dict[str, ModelUsage], after: dict[str, ModelUsage], per_second: dict[str, float],
             completed: int) -> RunCost:
    """The priced busy time between two `usage()` snapshots, over `completed` tasks."""
    if completed < 0:
        raise ValueError(f"completed: must be >= 0, got {completed}")
    busy = {m: u.busy_seconds for m, u in between(before, after).items()}
    return RunCost(busy, sum(s * per_second[m] for m, s in busy.items()), completed)


def home_model(output: RoutedOutput) -> str:
    """The model that decided every position: the first model (config order) that ran for the request.
    NOTE: a home model steps every position and a hand-off target only the positions sent to it, so the
    first model with computed tokens is the home for token-level policies (home = small), all-large and
    query-level routers (one model does everything) alike."""
    computed = output.metrics.tokens_computed
    return next((m for m in output.models if computed.get(m, 0) > 0), output.models[0])


def activated_parameters(outputs: list[RoutedOutput], params: dict[str, int], home_decides: bool = True) -> float:
    """Average parameters activated per output token. With `home_decides` (token-level routing) the home
    model runs every position, so every token counts its parameters, plus the writing model's where another
    model wrote it (the R2R convention: small + share x large). Without it (query-level routing, where a
    send moves the home for good) a token counts only the model that wrote it, and tokens the small model
    wrote before a late decision dropped them (`query-confidence:tokens=k`) count the small model's."""
    total = tokens = 0
    for out in outputs:
        home = home_model(out)
        tokens += len(out.tokens)
        total += out.metrics.discarded_tokens * params[out.models[0]]
        for m, count in out.metrics.tokens_per_model.items():
            total += count * params[m]
            if home_decides and m != home:
                total += count * params[home]
    return total / tokens if tokens else 0.0
