"""The policies the app offers: levels, parameters and defaults read from the registry, and spec strings."""
from __future__ import annotations

import pytest

from app.policies import default_choice, names, policy_info, resolve, starting_policy
from tokenrouter.policies import POLICIES, Policy


class FakeQueryRouter(Policy):
    name = "fake-query"
    level = "query"

    def __init__(self, threshold: float = 0.5, checkpoint: str = "none", share: float | None = None):
        self.threshold, self.checkpoint, self.share = threshold, checkpoint, share


@pytest.fixture
def with_query_router(monkeypatch):
    monkeypatch.setitem(POLICIES, FakeQueryRouter.name, FakeQueryRouter)


def test_levels_default_to_token_and_query_routers_are_listed_apart(with_query_router):
    assert policy_info("schedule").level == "token"
    assert "fake-query" in names("query") and "fake-query" not in names("token")
    assert default_choice("query", "all-small") == names("query")[0]


def test_without_query_routers_the_fallback_is_used(monkeypatch):
    for name in names("query"):
        monkeypatch.delitem(POLICIES, name)
    assert default_choice("query", "all-small") == "all-small"


def test_parameters_and_defaults_come_from_the_constructor(with_query_router):
    info = policy_info("fake-query")
    assert info.defaults == {"threshold": 0.5, "checkpoint": "none", "share": None} and info.has_threshold
    assert info.params_text() == "checkpoint=none" and info.optional == ["share"]
    assert info.params_text({"checkpoint": "a.pt"}) == "checkpoint=a.pt"
    assert policy_info("all-small").defaults == {}


def test_a_threshold_defaulting_to_none_is_a_parameter_not_the_slider(monkeypatch):
    class Calibrated(Policy):
        name = "calibrated"

        def __init__(self, threshold: float | None = None):
            self.threshold = 0.5 if threshold is None else threshold

    monkeypatch.setitem(POLICIES, Calibrated.name, Calibrated)
    info = policy_info("calibrated")
    assert not info.has_threshold and info.optional == ["threshold"] and info.params_text() == ""
    assert resolve("calibrated", "", 0.9)[0] == "calibrated"
    assert resolve("calibrated", "threshold=0.2", 0.9)[0] == "calibrated:threshold=0.2"


def test_spec_merges_name_parameters_and_threshold():
    assert resolve("schedule", "every=2", 0.3)[0] == "schedule:every=2"  # no threshold parameter
    assert resolve("confidence", "", 0.8)[0] == "confidence:threshold=0.8"
    assert resolve("confidence:threshold=0.7", "", 0.8)[0] == "confidence:threshold=0.7"
    spec, policy = resolve("random", "share=0.25,seed=3")
    assert spec == "random:share=0.25,seed=3" and policy.share == 0.25
    assert resolve("random", "0.25,seed=3")[0] == "random:share=0.25,seed=3"  # a bare value: the main parameter


@pytest.mark.parametrize("name, params, field", [("schedule", "every=0", "every"), ("nope", "", "policy"),
                                                 ("", "", "policy"), ("schedule", "every", "^every: must be"),
                                                 ("all-small", "3", "key=value")])
def test_bad_policies_raise_naming_the_field(name, params, field):
    with pytest.raises(ValueError, match=field):
        resolve(name, params)


def test_the_app_starts_at_the_given_policy_or_the_config_default(svc):
    assert starting_policy(svc, "schedule:every=2") == "schedule:every=2"
    assert starting_policy(svc) == "all-small"  # config/tiny/pair.yaml

    class Remote:
        models = ["small", "large"]

    assert policy_info(starting_policy(Remote())).level == "token"
