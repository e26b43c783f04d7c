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
