"""Cost in the app comes from `tokenrouter.bench.cost`, which prices each model's busy time by the config's
`price_per_hour`; a server publishes its prices in /v1/models, so requests through `--server` are priced too.
Every cost the app shows is written by `dollars_text`, in one format."""
from __future__ import annotations

import math

from tokenrouter.bench.cost import prices, request_cost, usage
from tokenrouter.service.output import RoutedOutput

SIGNIFICANT = 3  # every cost in plain decimals to 3 significant digits: $0.00930, $0.000968, never $9.68e-04


def can_price(service) -> bool:
    prices = getattr(service, "prices_per_hour", None)
    return bool(prices) and set(prices) >= set(service.models)


def dollars(output: RoutedOutput | None, service) -> float | None:
    """The request's cost, or None where it cannot be priced (no output, or a service without prices)."""
    return request_cost(output, service) if output is not None and can_price(service) else None


def prompt_tokens(service, prompt: str) -> int:
    """The prompt's length in tokens where the service can tell (in-process); 0 through a server."""
    encode = getattr(service, "encode", None)
    try:
        return len(encode(prompt)) if encode else 0
    except Exception:  # noqa: BLE001 -- only an estimate rests on it; the request itself reports the error
        return 0


def estimated_dollars(records: list, models: list[str], home: str, prompt: int, service) -> float | None:
    """What a request left early (Stop) cost so far, from its records: the engine reports the tokens each model
    ran forward only for a finished request. The home model ran the prompt and every token; another model ran
    everything up to the last token it wrote (its catch-up prefills). Priced as `request_cost` prices them."""
    if not records or not can_price(service):
        return None
    computed = {home: prompt + len(records)}
    for i, r in enumerate(records):
        if r.model != home:
            computed[r.model] = prompt + i + 1
    used, per_second = usage(service), prices(service)
    return sum(n * used[m].seconds_per_token * per_second[m] for m, n in computed.items())


def rounded(value: float) -> float:
    """A cost to SIGNIFICANT digits (tables)."""
    return float(f"{value:.{SIGNIFICANT}g}") if math.isfinite(value) else value


def dollars_text(value: float | None, estimated: bool = False) -> str:
    """$0.00930, $0.000968 (SIGNIFICANT digits, plain decimals); a dash while unknown; "~" when estimated."""
    if value is None or math.isnan(value):
        return "&ndash;"
    if math.isinf(value):
        return "&infin;"
    decimals = max(0, SIGNIFICANT - 1 - math.floor(math.log10(abs(value)))) if value else 0
    return f"{'~' if estimated else ''}${value:.{decimals}f}"
