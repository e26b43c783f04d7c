"""The streaming GGUF conversion writes what transformers' GGUF loader builds, tensor for tensor, in a fraction of
its memory (the 1.5B: 1.9 GB peak against 9.1 GB, docs/engine.md)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenrouter.models import gguf_convert
from tokenrouter.models.gguf_convert import hf_name, unpermute_rows
from tokenrouter.models.safetensors_io import SafetensorsReader, SafetensorsWriter

from tests.models.test_embedded import installed


@pytest.mark.embedded
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_conversion_equals_transformers_gguf_loader(name, tmp_path, monkeypatch):
    """SmolLM2 covers llama's q / k row permutation, the 0.5B tied embeddings (no lm_head in the file)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tokenrouter.models.embedded import EMBEDDED_MODELS, assemble
    model = EMBEDDED_MODELS[name]
    if not all(installed(part.distribution) for part in model.parts):
        pytest.skip(f"embedded:{name} not installed ({model.install_command})")
    gguf = assemble(model)
    out = gguf_convert.convert_gguf(gguf, tmp_path / name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    expected = hf.state_dict()
    if hf.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert set(f.keys()) == set(expected)
        for key in f.keys():
            assert torch.equal(f.get_tensor(key), expected[key]), key
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__]
    assert config["tie_word_embeddings"] == hf.config.tie_word_embeddings
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()


def test_names_map_to_the_decoder_families():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_name("blk.11.attn_k_norm.weight") == "model.layers.11.self_attn.k_norm.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("rope_freqs.weight") is None
    assert hf_name("blk.0.ffn_gate_exps.weight") is None


def test_unpermute_undoes_llama_cpp_permutation():
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's convert_hf_to_gguf: each head's rows as (2, head_dim / 2) swapped to (head_dim / 2, 2)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_rows(permuted, heads), w)


def test_writer_streams_row_blocks_and_checks_them(tmp_path):
    from safetensors.torch import load_file
    a, b = np.random.rand(5, 3).astype(np.float32), np.random.rand(4).astype(np.float32)
    c = torch.randint(0, 255, (3, 7), dtype=torch.uint8)
    h = torch.randn(2, 3).bfloat16()
    f32 = torch.float32
    with SafetensorsWriter(tmp_path / "m.safetensors", {"a": (f32, [5, 3]), "c": (torch.uint8, [3, 7]),
                                                         "b": (f32, [4]), "g": (torch.int64, []),
                                                         "h": (torch.bfloat16, [2, 3])}) as w:
        w.write("a", a[:2])
        w.write("a", a[2:])
        w.write("c", c)
        w.write("b", b)
        w.write("g", torch.tensor(32))
        w.write("h", h)
    got = load_file(tmp_path / "m.safetensors")
    assert np.array_equal(got["a"].numpy(), a) and np.array_equal(got["b"].numpy(), b)
    assert torch.equal(got["c"], c) and int(got["g"]) == 32 and torch.equal(got["h"], h)
    with pytest.raises(RuntimeError, match="expected a, got b"):
        with SafetensorsWriter(tmp_path / "x.safetensors", {"a": (f32, [2]), "b": (f32, [2])}) as w:
            w.write("b", b[:2])
    with pytest.raises(RuntimeError, match="a got 12 bytes, expected 8"):
        with SafetensorsWriter(tmp_path / "y.safetensors", {"a": (f32, [2])}) as w:
            w.write("a", b[:3])
    with pytest.raises(RuntimeError, match="1 tensors never written"):
        with SafetensorsWriter(tmp_path / "z.safetensors", {"a": (f32, [2]), "b": (f32, [2])}) as w:
            w.write("a", b[:2])


def test_reader_reads_what_safetensors_wrote_without_mapping_the_file(tmp_path):
    """SafetensorsReader gives back every dtype safetensors writes, reads into a given tensor in place, and maps
    nothing of the file (a mapped file's pages read by a load stay in the process's resident memory)."""
    from safetensors.torch import save_file
    tensors = {"f32": torch.randn(5, 3), "bf16": torch.randn(4, 2).bfloat16(), "f16": torch.randn(3).half(),
               "i64": torch.tensor(7), "i8": torch.randint(-128, 127, (6,), dtype=torch.int8),
               "u8": torch.randint(0, 255, (3, 7), dtype=torch.uint8), "bool": torch.tensor([True, False]),
               "empty": torch.zeros(0, 4)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    with SafetensorsReader(path) as f:
        assert sorted(f.keys()) == sorted(tensors) and f.metadata == {"format": "pt"}
        for name, t in tensors.items():
            got = f.read(name)
            assert got.dtype == t.dtype and torch.equal(got, t), name
        into = torch.empty(5, 3)
        assert f.read("f32", into) is into and torch.equal(into, tensors["f32"])
        assert f.read("f32", torch.empty(15)).shape == (5, 3)  # not the entry's shape: a fresh tensor
        if Path("/proc/self/maps").exists():
            assert str(path) not in Path("/proc/self/maps").read_text()
    path.write_bytes(path.read_bytes()[:-4])
    with SafetensorsReader(path) as f, pytest.raises(ValueError, match="bytes early"):
        [f.read(name) for name in f.keys()]
    path.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        SafetensorsReader(path)
