"""Cost in the app comes from `tokenrouter.bench.cost`, which prices each model's busy time by the config's
`price_per_hour`; a server publishes its prices in /v1/models, so requests through `--server` are priced too."""
from __future__ import annotations

from tokenrouter.bench.cost import request_cost
from tokenrouter.service.output import RoutedOutput


def can_price(service) -> bool:
    prices = getattr(service, "prices_per_hour", None)
    return bool(prices) and set(prices) >= set(service.models)


def dollars(output: RoutedOutput | None, service) -> float | None:
    """The request's cost, or None where it cannot be priced (no output, or a service without prices)."""
    return request_cost(output, service) if output is not None and can_price(service) else None
