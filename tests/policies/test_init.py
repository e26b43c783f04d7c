"""Policy specs (`tokenrouter/policies/__init__.py`): `name:key=value,...`, and a bare first value for a
policy's main parameter, as people type it."""
from __future__ import annotations

import pytest

from tokenrouter.policies import POLICIES, parse_policy, split_policy


@pytest.mark.parametrize("short, long", [
    ("confidence:0.9", "confidence:threshold=0.9"),
    ("random:0.15", "random:share=0.15"),
    ("entropy:2.0", "entropy:threshold=2.0"),
    ("logu:0.4,kind=aleatoric", "logu:threshold=0.4,kind=aleatoric"),
    ("schedule:3", "schedule:every=3"),
    ("rolling:entropy,window=2", "rolling:of=entropy,window=2"),
    ("query-random:0.25,seed=3", "query-random:share=0.25,seed=3"),
    ("query-confidence:0.7,tokens=4", "query-confidence:threshold=0.7,tokens=4"),
])
def test_a_bare_first_value_sets_the_main_parameter(short, long):
    assert split_policy(short) == split_policy(long)
    assert parse_policy(short).describe() == parse_policy(long).describe()


def test_every_main_parameter_is_a_constructor_parameter():
    import inspect

    for name, cls in POLICIES.items():
        if cls.main_param is not None:
            assert cls.main_param in inspect.signature(cls.__init__).parameters, name


@pytest.mark.parametrize("spec, message", [
    ("all-small:3", "'all-small' takes no bare value"),
    ("confidence:0.9,0.5", "only the first value may omit its key \\(it sets threshold\\)"),
    ("no-such:0.5", "unknown policy 'no-such'"),
    ("confidence:1.5", "^threshold: must be in \\[0, 1\\]"),
])
def test_bad_specs_name_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_policy(spec)


@pytest.mark.parametrize("spec, inner, deepest", [
    ("verify:of=(rolling:of=entropy,window=4),hold=16", "rolling", "entropy"),
    ("verify:of=(rolling:entropy),window=4,hold=16", "rolling", "entropy"),  # the wrapper's others still join
    ("rolling:of=(momentum:of=entropy,beta=0.5),window=4", "momentum", "entropy"),
    ("verify:of=(rolling:of=(momentum:of=logu,beta=0.5,k=5),window=4)", "rolling", "momentum"),
])
def test_a_wrapped_wrapper_is_written_in_parentheses_and_described_so(spec, inner, deepest):
    policy = parse_policy(spec)
    assert policy.inner.name == inner and policy.inner.inner.name == deepest
    assert parse_policy(policy.describe()).describe() == policy.describe()  # what it says reads back the same
    assert "(" in policy.describe()


def test_parentheses_around_a_plain_inner_policy_change_nothing():
    assert split_policy("verify:of=(confidence:threshold=0.8),hold=8") == \
        ("verify", {"of": "confidence:threshold=0.8", "hold": 8})
    assert parse_policy("verify:of=(confidence:threshold=0.8)").describe() == \
        parse_policy("verify:of=confidence,threshold=0.8").describe() == "verify:of=confidence,threshold=0.8,hold=32"
    policy = parse_policy("verify:of=(rolling:of=entropy,window=4),hold=16")
    assert (policy.draft_limit, policy.inner.window) == (16, 4)
    assert split_policy("rolling:(momentum:entropy)") == ("rolling", {"of": "momentum:entropy"})


@pytest.mark.parametrize("spec, message", [
    ("verify:of=rolling,of=entropy", r"'of' is given twice .* write it in parentheses: verify:of=\(rolling:"),
    ("confidence:threshold=0.8,threshold=0.9", "'threshold' is given twice"),
    ("verify:of=(rolling:of=entropy", "unbalanced parentheses"),
    ("verify:of=rolling:of=entropy)", "unbalanced parentheses"),
    ("verify:of=(rolling:entropy)x", r"parentheses hold a whole value"),
    ("verify:of=(rolling:of=entropy,window=2),window=3", r"of: \['window'\] given both"),
    ("rolling:of=verify,every=4", r"'verify' verifies, and only the outermost policy can: wrap the other way round"),
    ("verify:of=(verify:every=2)", "verifies already"),
])
def test_bad_nested_specs_say_what_to_write(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_policy(spec)
