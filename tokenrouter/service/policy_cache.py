"""Policies for requests from the network: the `routing` body field checked against the named policy's
declared constructor parameters (names and annotated types) before anything is built, no file paths (a
router is loaded from a path only through the server's config), and at most `size` distinct instances kept
(least recently used first out). Requests with equal parameters share one instance while it is cached, so
their sequences are scored in one batch."""
from __future__ import annotations

import inspect
import json
import math
import types
import typing
from collections import OrderedDict
from typing import Any

from tokenrouter.policies import POLICIES, Policy, make_policy, split_policy, split_wrapped
from tokenrouter.service.openai_protocol import redact_paths

MAX_STRING_CHARS = 256
MAX_INT = 2**31 - 1
SCALARS = (bool, int, float, str, type(None))
PATH_KEYS = ("path",)


class PolicyCache:
    def __init__(self, svc, size: int = 64):
        if size < 1:
            raise ValueError(f"policy_cache_size: must be >= 1, got {size}")
        self.svc, self.size = svc, size
        self._items: OrderedDict[tuple[str, str], Policy] = OrderedDict()
        self._hidden = _hidden_sizes(svc)

    def __len__(self) -> int:
        return len(self._items)

    def get(self, spec: str | None, params: dict[str, Any]) -> Policy:
        """The policy a request names (`spec`, e.g. "confidence:threshold=0.8", plus `params`); no spec:
        the config's. Raises ValueError naming the field."""
        default = self.svc.config.policy
        if spec is not None and not isinstance(spec, str):
            raise ValueError(f"routing.policy: must be a string, got {type(spec).__name__}")
        name, parsed = split_policy(spec) if spec else (default.name, {})
        given = {**parsed, **params}
        check_params(name, given)
        # NOTE: a request naming the config's policy starts from the config's parameters (its router path
        # among them); it may change the others.
        full = {**(default.params if name == default.name else {}), **given}
        key = (name, json.dumps(full, sort_keys=True, default=repr))
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        policy = make_policy(name, **full)
        home = policy.home(self.svc.models)
        try:
            policy.check_hidden_size(self._hidden[home])
        except ValueError as e:  # NOTE: it names the router's file, which the client must not learn
            raise ValueError(f"routing.policy: {name!r} cannot route this engine's {home!r} model: "
                             f"{redact_paths(str(e).removeprefix('path: '))}") from None
        self._items[key] = policy
        while len(self._items) > self.size:
            self._items.popitem(last=False)
        return policy


def check_params(name: str, params: dict[str, Any], field: str = "routing") -> None:
    """`params` against the constructor of policy `name`: known names, no paths, values of the declared
    types (bounded numbers and strings). A wrapper's extra parameters (`**inner_params`) are checked
    against its inner policy (`of`)."""
    if name not in POLICIES:
        raise ValueError(f"policy: unknown policy {name!r}; known: {sorted(POLICIES)}")
    declared, takes_more = _signature(POLICIES[name])
    for key, value in params.items():
        where = f"{field}.{key}"
        if key in PATH_KEYS:
            raise ValueError(f"{where}: a request cannot name a file; routers are loaded from the paths in the "
                             "server's config (send no `policy`, or the config's policy name, to use it)")
        _check_value(where, value, declared.get(key))
        if key not in declared and not takes_more:
            raise ValueError(f"{where}: policy {name!r} has no parameter {key!r}; it takes {sorted(declared)}")
    if takes_more:
        inner, extra = params.get("of"), {k: v for k, v in params.items() if k not in declared}
        optional = inspect.signature(POLICIES[name]).parameters["of"].default is None  # verify:every=k wraps none
        if inner is None and optional and not extra:
            return
        if not isinstance(inner, str):
            raise ValueError(f"{field}.of: policy {name!r} needs the inner policy's name, got {inner!r}")
        check_params(*split_wrapped(inner, extra), field)


def _signature(cls: type) -> tuple[dict[str, Any], bool]:
    """The constructor's named parameters with their annotations, and whether it takes **kwargs."""
    hints = typing.get_type_hints(cls.__init__) if cls.__init__ is not object.__init__ else {}
    named, more = {}, False
    for p in inspect.signature(cls).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            more = True
        elif p.kind is not p.VAR_POSITIONAL:
            named[p.name] = hints.get(p.name, Any)
    return named, more


def _check_value(where: str, value: Any, annotation: Any) -> None:
    if not isinstance(value, SCALARS):
        raise ValueError(f"{where}: must be a number, string, boolean or null, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: must be finite, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise ValueError(f"{where}: must be within +-{MAX_INT}, got {value}")
    if isinstance(value, str) and len(value) > MAX_STRING_CHARS:
        raise ValueError(f"{where}: at most {MAX_STRING_CHARS} characters, got {len(value)}")
    allowed = _types(annotation)
    if allowed is not None and not _is_a(value, allowed):
        names = " or ".join(sorted("null" if t is type(None) else t.__name__ for t in allowed))
        raise ValueError(f"{where}: must be {names}, got {value!r}")


def _types(annotation: Any) -> tuple[type, ...] | None:
    """The scalar types an annotation admits (None: any)."""
    if annotation is Any or annotation is inspect.Parameter.empty:
        return None
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        parts = [_types(a) for a in typing.get_args(annotation)]
        return None if any(p is None for p in parts) else tuple(t for p in parts for t in p)
    if annotation is type(None) or annotation in SCALARS:
        return (annotation,)
    return None


def _is_a(value: Any, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # NOTE: JSON true is not a number here, though Python's bool is an int
        return bool in allowed
    if isinstance(value, int) and float in allowed:
        return True
    return isinstance(value, allowed)


def _hidden_sizes(svc) -> dict[str, int]:
    """Each model's hidden size, from its config.json (what a trained router must have been trained on)."""
    from tokenrouter.models.decoder import DecoderConfig
    from tokenrouter.models.sources import resolve_model_dir

    return {m.name: DecoderConfig.from_dir(resolve_model_dir(m.source)).hidden_size for m in svc.config.models}
