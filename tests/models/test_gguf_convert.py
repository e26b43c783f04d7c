"""A GGUF as a model directory: its weights read from the GGUF equal what transformers' GGUF loader builds, tensor
for tensor; its int4 blocks are taken as codes that give the same values; an fp32 copy is written only for
transformers."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenrouter.models import gguf_convert
from tokenrouter.models.gguf_convert import GGUFWeights, export_safetensors, hf_name, unpermute_rows
from tokenrouter.models.quant import dequantize
from tokenrouter.models.safetensors_io import SafetensorsReader, SafetensorsWriter

from tests.models.test_embedded import installed_model


@pytest.mark.embedded
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_weights_read_from_the_gguf_equal_transformers_gguf_loader(name, tmp_path):
    """SmolLM2 covers llama's q / k row permutation, the 0.5B an lm_head of its own (Q8_0); the converted
    directory holds no weights until transformers asks for them, and then the same."""
    from transformers import AutoModelForCausalLM

    from tokenrouter.models.embedded import assemble
    gguf = assemble(installed_model(name))
    out = gguf_convert.convert_gguf(gguf, tmp_path / name)
    assert not list(out.glob("*.safetensors")) and gguf_convert.gguf_weights_path(out) == gguf
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    expected = hf.state_dict()
    if hf.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    with GGUFWeights(gguf) as f:
        assert set(f.keys()) == set(expected)
        for key in f.keys():
            assert torch.equal(f.read(key), expected[key]), key
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__]
    assert config["tie_word_embeddings"] == hf.config.tie_word_embeddings
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    if name.startswith("smollm2"):  # the export, on the small one
        with SafetensorsReader(export_safetensors(out) / "model.safetensors") as f:
            assert set(f.keys()) == set(expected)
            assert all(torch.equal(f.read(key), expected[key]) for key in f.keys())
        assert gguf_convert.gguf_weights_path(out) == gguf  # the engine still reads the GGUF


@pytest.mark.embedded
def test_metadata_parsed_over_a_plain_array_equals_transformers_own_parse():
    """The conversion's parse (once per file, gguf's reader over a plain view of the memory map) gives what
    transformers' loader gives on its own, config and tokenizer fields alike, and puts gguf's reader back."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as loader

    from tokenrouter.models.embedded import assemble
    path = assemble(installed_model("smollm2-135m-instruct"))
    stock_reader, stock_loader = gguf.GGUFReader, loader.load_gguf_checkpoint
    expected = loader.load_gguf_checkpoint(path, return_tensors=False)
    with gguf_convert._gguf_metadata_parsed_once():
        assert loader.load_gguf_checkpoint is not stock_loader
        parsed = loader.load_gguf_checkpoint(path, return_tensors=False)
        assert gguf.GGUFReader is stock_reader  # replaced only while a file is parsed
        again = loader.load_gguf_checkpoint(path, return_tensors=False)
    assert parsed == expected and again == expected and again is not parsed
    assert len(parsed["tokenizer"]["tokens"]) == 49152
    assert gguf.GGUFReader is stock_reader and loader.load_gguf_checkpoint is stock_loader


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]], heads: int = 0) -> None:
    import gguf
    writer = gguf.GGUFWriter(path, arch)
    if heads:
        writer.add_head_count(heads)
        writer.add_head_count_kv(heads)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_blocks(kind, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a 4-bit GGUF type, with sane fp16 scales (random bytes there could be inf / nan)."""
    from gguf import GGMLQuantizationType as T
    from gguf.constants import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    halves = 2 if kind in (T.Q4_K, T.Q4_1) else 1  # d (and dmin / m) lead each block
    scales = rng.uniform(-0.02, 0.02, (rows, cols // block, halves)).astype(np.float16)
    raw[..., :2 * halves] = scales.view(np.uint8).reshape(rows, cols // block, 2 * halves)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q4_0", "Q4_1"])
def test_int4_blocks_are_taken_as_codes_with_the_gguf_s_values(kind, tmp_path):
    """GGUFWeights.int4 gives codes, scales and offsets whose values are the GGUF's dequantized ones (Q4_K, Q4_1
    bit for bit; Q4_0 within an ulp), rows unpermuted like the weights (llama q / k); other types give None."""
    from gguf import GGMLQuantizationType as T
    rng = np.random.default_rng(0)
    kind = T[kind]
    heads, head_dim, cols = 4, 8, 512
    rows = heads * head_dim
    tensors = {"blk.0.attn_q.weight": (random_blocks(kind, rows, cols, rng), kind),
               "blk.0.ffn_up.weight": (random_blocks(kind, 64, cols, rng), kind),
               "blk.0.ffn_down.weight": (rng.standard_normal((cols, 64)).astype(np.float32), T.F32)}
    write_gguf(tmp_path / "m.gguf", "llama", tensors, heads=heads)
    with GGUFWeights(tmp_path / "m.gguf") as f:
        assert f.int4("model.layers.0.mlp.down_proj.weight", 32) is None
        assert f.int4("model.layers.0.mlp.up_proj.weight", 64) is None  # GGUF groups are 32 values
        for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"):
            q, w = f.int4(key, 32), f.read(key)
            assert q.codes.shape == w.shape and q.group == 32 and q.exact == 1.0 and int(q.codes.max()) <= 15
            if kind == T.Q4_0:
                torch.testing.assert_close(dequantize(q), w, rtol=0, atol=float(w.abs().max()) * 2**-22)
            else:
                assert torch.equal(dequantize(q), w), key
        from gguf.quants import dequantize as gguf_dequantize
        raw = gguf_dequantize(tensors["blk.0.attn_q.weight"][0], kind)
        assert torch.equal(f.read("model.layers.0.self_attn.q_proj.weight"),
                           torch.from_numpy(unpermute_rows(raw, heads)))


def test_a_projection_from_gguf_int4_blocks_loads_as_their_codes(tmp_path, monkeypatch):
    """load_quantized takes a GGUF projection's 4-bit blocks (Q4_1 here: the tiny model's rows are too short for
    Q4_K) as its int4 codes, a fused q / k / v from parts of different types (the 4-bit ones taken, the others
    fitted), and caches them."""
    from gguf import GGMLQuantizationType as T

    from tokenrouter.models.decoder import DecoderConfig, DecoderLM
    from tokenrouter.models.prepare import load_quantized, quantize
    from tokenrouter.models.tiny import build_tiny_model_dir

    model_dir = build_tiny_model_dir("qwen2")
    cfg = DecoderConfig.from_dir(model_dir)
    rng = np.random.default_rng(1)
    gguf_dir = tmp_path / "converted"
    gguf_dir.mkdir()
    tensors = {}
    with SafetensorsReader(next(model_dir.glob("*.safetensors"))) as f:
        names = {}
        for stem, name in gguf_convert.GGUF_NAMES.items():
            names[f"{name}.weight"] = f"{stem}.weight"
        for i in range(cfg.num_layers):
            for stem, name in gguf_convert.GGUF_LAYER_NAMES.items():
                for kind in ("weight", "bias"):
                    names[f"model.layers.{i}.{name}.{kind}"] = f"blk.{i}.{stem}.{kind}"
        for key in f.keys():
            w = f.read(key).float().numpy()
            quantized = key.endswith(("q_proj.weight", "up_proj.weight"))
            tensors[names[key]] = ((random_blocks(T.Q4_1, w.shape[0], w.shape[1], rng), T.Q4_1) if quantized
                                   else (np.ascontiguousarray(w), T.F32))
    write_gguf(tmp_path / "m.gguf", "qwen2", tensors)
    for file in model_dir.iterdir():
        if file.suffix != ".safetensors":
            (gguf_dir / file.name).write_bytes(file.read_bytes())
    gguf = tmp_path / "m.gguf"
    (gguf_dir / gguf_convert.SOURCE_FILE).write_text(json.dumps(
        {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "weights": "gguf"}))
    model = DecoderLM(cfg, 64)
    codes = load_quantized(model, gguf_dir, "int4", 32, tmp_path / "codes.safetensors")
    with GGUFWeights(gguf) as f:
        for i in range(cfg.num_layers):
            qkv = codes[f"layers.{i}.self_attn.qkv_proj"]
            q = f.int4(f"model.layers.{i}.self_attn.q_proj.weight", 32)
            assert torch.equal(qkv.codes[:len(q.codes)], q.codes) and torch.equal(qkv.scale[:len(q.codes)], q.scale)
            k = f.read(f"model.layers.{i}.self_attn.k_proj.weight")
            rows = slice(len(q.codes), len(q.codes) + len(k))
            fitted = quantize(k, "int4", 32)
            assert torch.equal(qkv.codes[rows], fitted.codes) and torch.equal(qkv.low[rows], fitted.low)
        assert torch.equal(model.embed_tokens.weight, f.read("model.embed_tokens.weight"))
    assert (tmp_path / "codes.safetensors").is_file()


def test_a_file_that_is_no_gguf_or_is_cut_short_is_named_in_a_value_error(tmp_path):
    from tokenrouter.models.gguf_convert import read_header
    write_gguf(tmp_path / "m.gguf", "llama", {"blk.0.ffn_norm.weight": (np.ones(8, np.float32), None)})
    meta, tensors = read_header(tmp_path / "m.gguf")
    assert meta["general.architecture"] == "llama" and [t[0] for t in tensors] == ["blk.0.ffn_norm.weight"]
    for name, data in (("empty.gguf", b""), ("other.gguf", b"GGML" + bytes(60)),
                       ("cut.gguf", (tmp_path / "m.gguf").read_bytes()[:40])):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=name):
            read_header(tmp_path / name)


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
