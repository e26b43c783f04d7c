"""Every policy block in config/policies/ loads, and the shipped routers for the embedded pair are valid
checkpoints whose metadata reports what they were trained and calibrated on."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenrouter.policies import POLICIES, load_policy
from tokenrouter.policies.checkpoint import default_router_path, load_router

BLOCKS = sorted(Path("config/policies").glob("*.yaml"))


@pytest.mark.parametrize("path", BLOCKS, ids=lambda p: p.stem)
def test_policy_block_loads(path):
    policy = load_policy(path)
    assert policy.name in POLICIES and policy.level in ("token", "query")


def test_every_policy_has_a_config():
    assert {load_policy(p).name for p in BLOCKS} == set(POLICIES) - {"schedule"}


@pytest.mark.parametrize("kind", ["neural", "probe", "query"])
def test_shipped_router(kind):
    path = default_router_path(kind)
    assert path.stat().st_size < 2 * 2**20
    net, meta = load_router(path, kind)
    assert meta["pair"] == {"small": "embedded:qwen2.5-coder-0.5b-instruct",
                            "large": "embedded:qwen2.5-coder-1.5b-instruct"}
    assert net.inputs["hidden"] == 896
    assert meta["command"].startswith(("python -m tokenrouter.training.train --config config/embedded/",
                                       # trained before the pipeline moved out of policies/ (same code)
                                       "python -m tokenrouter.policies.train --config config/embedded/"))
    for key in ("precision", "recall", "share", "auc"):
        assert 0 <= meta["held_out"][key] <= 1


def test_bad_blocks_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy: entropy\n")
    with pytest.raises(ValueError, match="bad.yaml"):
        load_policy(bad)
    bad.write_text("policy: {name: entropy, params: {threshold: -2}}\n")
    with pytest.raises(ValueError, match="threshold"):
        load_policy(bad)
