"""Policies built from request parameters: checked against each constructor's declared parameters, no file
paths, a bounded number of instances, equal parameters sharing one."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenrouter.config import load_config
from tokenrouter.policies import POLICIES
from tokenrouter.service.policy_cache import PolicyCache, check_params

PAIR = "config/tiny/pair.yaml"


def cache(size: int = 3, policy: dict | None = None) -> PolicyCache:
    config = load_config(PAIR, **({"policy": policy} if policy else {}))
    return PolicyCache(SimpleNamespace(config=config, models=[m.name for m in config.models]), size)


def test_equal_parameters_share_an_instance_and_the_oldest_leaves_first():
    c = cache(size=2)
    a = c.get("confidence", {"threshold": 0.5})
    assert c.get("confidence:threshold=0.5", {}) is a
    b = c.get("entropy", {})
    c.get("confidence", {"threshold": 0.5})  # a is used again: b is now the oldest
    c.get("schedule", {"every": 3})
    assert len(c) == 2
    assert c.get("confidence", {"threshold": 0.5}) is a and c.get("entropy", {}) is not b


def test_no_policy_is_the_configs_and_its_parameters_carry_over():
    c = cache(policy={"name": "confidence", "params": {"threshold": 0.7}})
    assert c.get(None, {}).top1_threshold == 0.7
    assert c.get("confidence", {}).top1_threshold == 0.7
    assert c.get(None, {"threshold": 0.2}).top1_threshold == 0.2


def test_every_shipped_policy_declares_what_it_takes():
    for name in POLICIES:
        check_params(name, {"of": "entropy"} if name in ("rolling", "momentum") else {})
    check_params("rolling", {"of": "logu", "window": 3, "k": 5, "kind": "aleatoric", "threshold": 0.1})
    check_params("neural", {"threshold": None, "share": 0.2})
    with pytest.raises(ValueError, match=r"^routing\.k: policy 'entropy' has no parameter 'k'"):
        check_params("rolling", {"of": "entropy", "k": 5})
    with pytest.raises(ValueError, match=r"^routing\.share: must be float or null"):
        check_params("probe", {"share": "a lot"})
    with pytest.raises(ValueError, match="^policy: unknown policy"):
        check_params("rolling", {"of": "oracle"})


def test_a_wrapped_wrappers_parameters_are_checked_like_its_wrappers():
    check_params("verify", {"of": "rolling:of=logu,window=3,k=5", "hold": 8})
    check_params("verify", {"of": "(rolling:of=(momentum:of=entropy,beta=0.5))"})
    with pytest.raises(ValueError, match=r"^routing\.path: a request cannot name a file"):
        check_params("verify", {"of": "rolling:of=(probe:path=/etc/passwd)"})
    with pytest.raises(ValueError, match=r"^routing\.k: policy 'entropy' has no parameter 'k'"):
        check_params("verify", {"of": "rolling:of=entropy,k=5"})


def test_a_bad_value_never_reaches_the_cache():
    c = cache()
    for spec, params in (("confidence", {"threshold": 2.0}), ("confidence", {"threshold": float("nan")}),
                         ("neural", {}), ("neural", {"path": "/etc/passwd"})):
        with pytest.raises(ValueError):
            c.get(spec, params)
    assert len(c) == 0


def test_verify_takes_every_or_a_wrapped_policy_and_its_parameters():
    check_params("verify", {"every": 4})
    check_params("verify", {"of": "confidence", "threshold": 0.8, "hold": 8})
    with pytest.raises(ValueError, match=r"^routing\.k: policy 'confidence' has no parameter 'k'"):
        check_params("verify", {"of": "confidence", "k": 3})
    with pytest.raises(ValueError, match=r"^routing\.of"):
        check_params("verify", {"threshold": 0.8})
