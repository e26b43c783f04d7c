"""Routing policies, by name: `make_policy("confidence", threshold=0.9)` or `parse_policy("confidence:threshold=0.9")`.
Every class has a `level`: "token" (decided per token) or "query" (one model for the whole response)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenrouter.policies.base import Policy, StepFeatures
from tokenrouter.policies.query import QueryClassifier, QueryConfidence, QueryRandom
from tokenrouter.policies.simple import AllLarge, AllSmall, Confidence, RandomShare, Schedule
from tokenrouter.policies.smoothing import Momentum, Rolling
from tokenrouter.policies.trained import Neural, Probe
from tokenrouter.policies.uncertainty import Entropy, LogU
from tokenrouter.policies.verify import Verify

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (
    AllSmall, AllLarge, RandomShare, Schedule, Confidence, Entropy, LogU, Neural, Probe, Rolling, Momentum,
    QueryRandom, QueryConfidence, QueryClassifier, Verify)}

__all__ = ["POLICIES", "Policy", "StepFeatures", "load_policy", "make_policy", "parse_policy", "split_policy", "split_wrapped",
           "top_level"]


def make_policy(name: str | Policy, **params: Any) -> Policy:
    if isinstance(name, Policy):
        return name
    if name not in POLICIES:
        raise ValueError(f"policy: unknown policy {name!r}; known: {sorted(POLICIES)}")
    try:
        policy = POLICIES[name](**params)
    except TypeError as e:
        raise ValueError(f"policy {name!r}: bad parameters {params}: {e}") from None
    policy.spec = (name, dict(params))  # how a worker in another process builds its own copy
    return policy


def parse_policy(text: str) -> Policy:
    """`name`, `name:key=value,key=value` (values parsed as int, float or str), or `name:value,...` where
    the bare first value sets the policy's `main_param` (`confidence:0.9`, `random:0.15`, `rolling:entropy`).
    A value in parentheses is a whole spec, kept as a string: a wrapper's inner policy that has parameters
    of the wrapper's own names (`verify:of=(rolling:of=entropy,window=4),hold=16`)."""
    name, params = split_policy(text)
    return make_policy(name, **params)


def split_policy(text: str) -> tuple[str, dict[str, Any]]:
    name, _, rest = text.partition(":")
    name = name.strip()
    params = {}
    for i, item in enumerate(s.strip() for s in top_level(rest, text) if s.strip()):
        key, eq, value = ("", "", item) if item.startswith("(") else item.partition("=")
        if not eq:
            key, value = _main_param(name, text, item, first=i == 0), item
        key, value = key.strip(), value.strip()
        if key in params:
            raise ValueError(f"policy: {key!r} is given twice in {text!r}; to give a wrapped policy parameters of "
                             f"its wrapper's names, write it in parentheses: verify:of=(rolling:of=entropy,window=4)")
        if value.startswith("(") and value.endswith(")"):
            params[key] = value[1:-1].strip()
        elif "(" in value or ")" in value:
            raise ValueError(f"policy: parentheses hold a whole value (key=(spec)) in {text!r}, got {item!r}")
        else:
            params[key] = _number(value)
    return name, params


def split_wrapped(of: str, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A wrapper's inner policy and its parameters: `of` names it, and the wrapper's parameters beyond its own
    (`params`) go to it; or `of` is a whole spec (`rolling:of=entropy,window=4`) that those parameters join."""
    of = of.strip()
    if of.startswith("(") and of.endswith(")"):
        of = of[1:-1]
    name, own = split_policy(of) if ":" in of else (of.strip(), {})
    both = sorted(set(own) & set(params))
    if both:
        raise ValueError(f"of: {both} given both in {of!r} and beside it")
    return name, {**own, **params}


def top_level(rest: str, text: str = "") -> list[str]:
    """`rest` split at the commas outside parentheses (`text`: the whole spec, for the error)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(rest):
        depth += (char == "(") - (char == ")")
        if depth < 0:
            break
        if char == "," and depth == 0:
            items.append(rest[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"policy: unbalanced parentheses in {text or rest!r}")
    return [*items, rest[start:]]


def _main_param(name: str, text: str, item: str, first: bool) -> str:
    """The parameter a bare value sets: only the first value may omit its key, and only for a policy
    that has a main parameter."""
    if name not in POLICIES:
        raise ValueError(f"policy: unknown policy {name!r}; known: {sorted(POLICIES)}")
    main = POLICIES[name].main_param
    if main is None:
        raise ValueError(f"policy: {name!r} takes no bare value; expected key=value in {text!r}, got {item!r}")
    if not first:
        raise ValueError(f"policy: only the first value may omit its key (it sets {main}); expected key=value "
                         f"in {text!r}, got {item!r}")
    return main


def _number(value: str) -> Any:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def load_policy(path: str | Path) -> Policy:
    """A policy from a YAML file holding an engine config's `policy:` block (see config/policies/)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) if Path(path).is_file() else None
    block = data.get("policy") if isinstance(data, dict) else None
    if not isinstance(block, dict) or not isinstance(block.get("name"), str):
        raise ValueError(f"{path}: expected a mapping 'policy:' with a string 'name' (and optional 'params')")
    params = block.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{path}: policy.params must be a mapping")
    return make_policy(block["name"], **params)
