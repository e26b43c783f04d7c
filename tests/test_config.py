"""YAML configs map 1:1 onto the dataclasses; every problem names the file and the key."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenrouter.config import ConfigError, load_config

MINIMAL = "models:\n  - name: small\n    source: tiny:qwen2\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


ENGINE_CONFIGS = sorted(p for p in Path("config").rglob("*.yaml") if p.parent.name != "policies")  # policies/: blocks


@pytest.mark.parametrize("path", ENGINE_CONFIGS, ids=[str(p) for p in ENGINE_CONFIGS])
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.models and cfg.path == str(path)


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL), scheduler={"delay_tau_ms": 20}, seed=3)
    assert cfg.models[0].block_size == 16 and cfg.policy.name == "all-small"
    assert cfg.scheduler.delay_tau_ms == 20.0 and cfg.scheduler.max_num_seqs == 64 and cfg.seed == 3


@pytest.mark.parametrize("text, message", [
    (MINIMAL + "    blok_size: 4\n", r"c.yaml: models\[0\].blok_size: unknown key"),
    (MINIMAL + "    block_size: four\n", r"c.yaml: models\[0\].block_size: expected int, got str"),
    (MINIMAL + "    block_size: 0\n", r"c.yaml: models\[0\].block_size: must be >= 1"),
    (MINIMAL + "    dtype: float64\n", r"models\[0\].dtype: must be one of"),
    (MINIMAL + "schedulr: {}\n", r"c.yaml: schedulr: unknown key"),
    (MINIMAL + "scheduler: {max_num_seqs: true}\n", r"scheduler.max_num_seqs: expected int, got bool"),
    ("models:\n  - source: tiny:qwen2\n", r"models\[0\].name: required key missing"),
    ("models: []\n", r"models: needs at least one model"),
    (MINIMAL + "  - name: small\n    source: tiny:qwen3\n", r"model names must be unique"),
    ("models: [\n", r"c.yaml: invalid YAML"),
])
def test_errors_name_the_file_and_the_key(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_cuda_and_cuda_0_name_one_device_and_ranks_get_the_next_gpus():
    from tokenrouter.config import ConfigError, ModelSpec

    assert ModelSpec("m", "s", device="cuda").device == ModelSpec("m", "s", device="cuda:0").device == "cuda:0"
    assert ModelSpec("m", "s", device="cuda:1", tensor_parallel_size=2).devices == ["cuda:1", "cuda:2"]
    with pytest.raises(ConfigError, match="devices"):
        ModelSpec("m", "s", devices=["cuda", "cuda:0"], tensor_parallel_size=2)


def test_flash_attention_refuses_float32_before_looking_for_a_gpu():
    from tokenrouter.models.attention import choose_backend

    with pytest.raises(ValueError, match="float16 or bfloat16"):
        choose_backend("flash", "cuda:0", 256, "float32")
    from tokenrouter.models import native
    assert choose_backend("auto", "cpu", 16, "float32").name == ("torch" if native.cpu_ops_missing() else "cpu")


def test_auto_attention_is_triton_on_cuda_where_triton_is_installed(monkeypatch):
    import importlib.util

    from tokenrouter.models.attention import choose_backend

    expected = "triton" if importlib.util.find_spec("triton") else "torch"
    assert choose_backend("auto", "cuda:0", 16, "bfloat16").name == expected
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        choose_backend("triton", "cpu", 16, "float32")
    with pytest.raises(ValueError, match="attention_backend: must be one of"):
        choose_backend("paged", "cpu", 16, "float32")


def test_cuda_graph_batch_follows_the_scheduler_unless_set():
    from tokenrouter.config import ConfigError, EngineConfig, ModelSpec, SchedulerSpec

    cfg = EngineConfig([ModelSpec("a", "s"), ModelSpec("b", "s", cuda_graph_max_batch=8)], scheduler=SchedulerSpec(32))
    assert [m.cuda_graph_max_batch for m in cfg.models] == [32, 8]
    with pytest.raises(ConfigError, match="cuda_graphs"):
        ModelSpec("m", "s", cuda_graphs="yes")
