"""Cost in the app comes from `tokenrouter.bench.cost`, which prices each model's busy time by the config's
`price_per_hour`. An in-process service carries its config; a server does not report its prices, so
requests through `--server` show no cost."""
from __future__ import annotations

from tokenrouter.bench.cost import request_cost
from tokenrouter.service.output import RoutedOutput


def can_price(service) -> bool:
    return getattr(service, "config", None) is not None


def dollars(output: RoutedOutput | None, service) -> float | None:
    """The request's cost, or None where it cannot be priced (no output, or a remote service)."""
    return request_cost(output, service) if output is not None and can_price(service) else None
