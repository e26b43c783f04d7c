"""The policies the app offers, read from the registry: their level (token or query), their parameters
with defaults, and the spec string ("name:key=value,...") a choice of controls stands for."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

from tokenrouter.policies import POLICIES, Policy, make_policy, split_policy


@dataclass(frozen=True, slots=True)
class PolicyInfo:
    name: str
    level: str  # "token": routes every token; "query": picks one model per request
    defaults: dict[str, Any]  # constructor parameters and their defaults

    @property
    def has_threshold(self) -> bool:
        """Whether the threshold slider applies: the policy takes a threshold with a numeric default."""
        return isinstance(self.defaults.get("threshold"), (int, float))

    @property
    def optional(self) -> list[str]:
        """Parameters defaulting to None (e.g. a trained router's calibrated threshold or target share)."""
        return [k for k, v in self.defaults.items() if v is None]

    def params_text(self, given: dict[str, Any] | None = None) -> str:
        """Every set parameter but a slider threshold as key=value,...: the `given` values, the defaults
        for the rest."""
        values = {**self.defaults, **(given or {})}
        return ",".join(f"{k}={v}" for k, v in values.items()
                        if v is not None and not (k == "threshold" and self.has_threshold))


def policy_info(name: str) -> PolicyInfo:
    if name not in POLICIES:
        raise ValueError(f"policy: unknown policy {name!r}; known: {sorted(POLICIES)}")
    cls = POLICIES[name]
    defaults = {p.name: p.default for p in inspect.signature(cls.__init__).parameters.values()
                if p.default is not inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD}
    return PolicyInfo(name, getattr(cls, "level", "token"), defaults)


def names(level: str | None = None) -> list[str]:
    """Registered policy names, of one level or all."""
    return [n for n in POLICIES if level is None or policy_info(n).level == level]


def default_choice(level: str, fallback: str) -> str:
    """The first policy of a level, else `fallback` (e.g. no query-level router registered yet)."""
    found = names(level)
    return found[0] if found else fallback


@functools.lru_cache(maxsize=64)
def resolve(name: str, params_text: str = "", threshold: float | None = None) -> tuple[str, Policy]:
    """The spec string for a policy and its controls, and the policy it builds (which validates it: bad
    values raise ValueError naming the field). `name` may itself carry parameters ("schedule:every=2")."""
    if not name:
        raise ValueError("policy: choose a policy")
    base, params = split_policy(name)
    _, extra = split_policy(f"{base}:{params_text or ''}")
    params.update(extra)
    if threshold is not None and policy_info(base).has_threshold and "threshold" not in params:
        params["threshold"] = float(threshold)
    return spec_string(base, params), make_policy(base, **params)


def spec_string(name: str, params: dict[str, Any]) -> str:
    return name + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")


def starting_policy(service, policy: str | None = None) -> str:
    """The policy the app starts with: `policy` if given, else the engine config's default (in-process
    services carry their config), else the first token-level policy."""
    if policy:
        return policy
    config = getattr(service, "config", None)
    if config is None:
        return default_choice("token", "confidence")
    return spec_string(config.policy.name, config.policy.params)
