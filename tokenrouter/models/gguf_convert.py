"""A GGUF file as a model directory. Its config and tokenizer are written once; its weights stay in the GGUF and
are read from it at every load (GGUFWeights), dequantized to fp32 a block of rows at a time, or handed over as
they are where a projection's blocks are already 4-bit codes with a scale and an offset per 32 values (Q4_K,
Q4_0, Q4_1). An fp32 safetensors copy, which transformers needs, is written only when asked for
(export_safetensors): the default int4 start writes none (the embedded pair's fp32 copy was 9.6 GB and took
most of a first start to write)."""
from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokenrouter.bench import progress
from tokenrouter.models.quant import Int4Weight
from tokenrouter.models.safetensors_io import FileReader, SafetensorsWriter, read_exact
from tokenrouter.models.sources import log

SOURCE_FILE = "tokenrouter_source.json"  # in a converted directory: the GGUF it came from and reads weights from


def gguf_chat_template(gguf_path: Path) -> str | None:
    return read_header(gguf_path)[0].get("tokenizer.chat_template")


# GGUF tensor names (llama.cpp's) -> Hugging Face names, for the decoder families we run (llama, qwen2, qwen3)
GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
ROWS_PER_CHUNK = 4096  # rows dequantized at once: a chunk of the 1.5B's embedding is 25 MB in fp32


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one the decoder does not use (e.g. rope_freqs)."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in GGUF_NAMES:
        return f"{GGUF_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_LAYER_NAMES[parts[2]]}.{kind}"
    return None


def unpermute_rows(w, heads: int):
    """llama.cpp's converter interleaves the rotary halves of each llama q / k head's rows; undo it (as
    transformers' GGUF loader does), so rotate-half rotary applies. Any array or tensor whose rows are the
    projection's (its weights, or its codes and their scales)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True, slots=True)
class _Entry:
    kind: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # Hugging Face order: [rows, columns] or [n]
    offset: int  # of the tensor's first byte in the file
    values_per_block: int
    block_bytes: int  # of one quantization block (a row is a whole number of them)
    heads: int  # llama q / k: heads whose rows llama.cpp permuted (0: none)

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) > 1 else 1

    @property
    def row_bytes(self) -> int:
        return self.shape[-1] // self.values_per_block * self.block_bytes


def _q4_k(blocks: np.ndarray):
    # blocks: [n, 144] uint8 of 256 values: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
    # nibbles -> codes [n, 256], scale, low [n, 8]: value = d * sc * q - dmin * m, per 32 values
    from gguf.quants import Q4_K
    n = len(blocks)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    # NOTE: 32 bytes of nibbles hold two groups: the low nibbles the first, the high nibbles the next
    codes = (blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    return codes.reshape(n, 256), d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_1(blocks: np.ndarray):
    # blocks: [n, 20]: f16 d, f16 m, 16 bytes of nibbles (values 0-15 low, 16-31 high): value = d * q + m
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return _nibbles_32(blocks[:, 4:]), d, m


def _q4_0(blocks: np.ndarray):
    # blocks: [n, 18]: f16 d, 16 bytes of nibbles: value = d * (q - 8), here d * q + (-8 d): within an ulp
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    return _nibbles_32(blocks[:, 2:]), d, -8 * d


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    return np.concatenate((qs & 15, qs >> 4), axis=1)


def _int4_decoders() -> dict:
    from gguf import GGMLQuantizationType as T
    return {T.Q4_K: _q4_k, T.Q4_1: _q4_1, T.Q4_0: _q4_0}


# GGUF metadata value types: struct formats of the fixed-size ones (8: string, 9: array)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_header(path: Path) -> tuple[dict, list[tuple[str, tuple[int, ...], int, int]]]:
    """A GGUF file's scalar and string metadata (arrays skipped: the tokenizer's, read by transformers) and its
    tensors as (name, dims in GGUF order, type, absolute offset of the data). gguf's GGUFReader builds every
    field, the vocabulary's 300,000 strings included, as numpy views: 6-12 s per file on 2 cores; this reads the
    header alone, in a fraction of a second."""
    import struct
    try:
        return _read_header(path)
    except (struct.error, ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a GGUF file this reader knows ({error})") from error


def _read_header(path: Path) -> tuple[dict, list[tuple[str, tuple[int, ...], int, int]]]:
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        def unpack(fmt: str):
            nonlocal at
            value = struct.unpack_from("<" + fmt, m, at)
            at += struct.calcsize("<" + fmt)
            return value[0] if len(value) == 1 else value

        def string() -> str:
            nonlocal at
            n = unpack("Q")
            at += n
            return m[at - n:at].decode("utf-8", errors="replace")

        def value(kind: int):
            nonlocal at
            if kind in _GGUF_SCALARS:
                return unpack(_GGUF_SCALARS[kind])
            if kind == 8:
                return string()
            if kind != 9:
                raise ValueError(f"unknown metadata type {kind}")
            item, n = unpack("I"), unpack("Q")
            if item in _GGUF_SCALARS:
                at += n * struct.calcsize("<" + _GGUF_SCALARS[item])
            else:
                for _ in range(n):
                    value(item)
            return None

        at = 0
        magic, version, n_tensors, n_meta = unpack("4sIQQ")
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"magic {magic!r}, version {version}")
        meta = {}
        for _ in range(n_meta):
            key = string()
            got = value(unpack("I"))
            if got is not None:
                meta[key] = got
        tensors = []
        for _ in range(n_tensors):
            name = string()
            dims = unpack(f"{unpack('I')}Q")
            dims = (dims,) if isinstance(dims, int) else tuple(dims)
            tensors.append((name, dims, unpack("I"), unpack("Q")))
        align = meta.get("general.alignment", 32)
        start = at + (-at % align)
        return meta, [(name, dims, kind, start + offset) for name, dims, kind, offset in tensors]


class GGUFWeights(FileReader):
    """A GGUF's tensors under their Hugging Face names (the SafetensorsReader interface: keys, read), read with
    plain reads, so what a load has read does not stay in the process's resident memory, and dequantized to
    fp32 a block of rows at a time. `int4` hands over a projection whose blocks are already int4 codes."""

    def __init__(self, path: Path):
        from gguf import GGMLQuantizationType
        from gguf.constants import GGML_QUANT_SIZES
        self.path = Path(path)
        meta, tensors = read_header(self.path)
        arch = meta.get("general.architecture")
        heads = {}
        if arch == "llama":  # NOTE: llama.cpp permutes llama's q / k rows only
            heads = {"q_proj": meta[f"{arch}.attention.head_count"], "k_proj": meta[f"{arch}.attention.head_count_kv"]}
        self.entries: dict[str, _Entry] = {}
        for gguf_name, dims, kind, offset in tensors:
            name = hf_name(gguf_name)
            if name is None:
                continue
            if name in self.entries:
                raise RuntimeError(f"{self.path}: two tensors map to {name}")
            kind = GGMLQuantizationType(kind)
            shape = tuple(reversed(dims))
            block, size = GGML_QUANT_SIZES[kind]
            proj = name.rsplit(".", 2)[-2]
            self.entries[name] = _Entry(kind, shape, offset, block, size,
                                        heads.get(proj, 0) if name.endswith(".weight") else 0)
        self.file = open(self.path, "rb", buffering=0)

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name` in fp32, or dequantized into `out` where it is a contiguous CPU tensor of its shape (a
        parameter loaded in place, in its own dtype)."""
        e = self.entries[name]
        if out is None or not (tuple(out.shape) == e.shape and out.is_contiguous() and out.device.type == "cpu"):
            out = torch.empty(e.shape, dtype=torch.float32)
        rows = out.view(e.rows, -1)
        for start, w in self.blocks(name):
            rows[start:start + len(w)].copy_(torch.from_numpy(w))
        return out

    def blocks(self, name: str):
        """(first row, fp32 rows [n, columns]) of tensor `name`, a block of rows at a time."""
        from gguf.quants import dequantize
        e = self.entries[name]
        rows = e.rows
        step = rows if e.heads else ROWS_PER_CHUNK  # a permuted projection moves rows across blocks: whole
        for start in range(0, rows, step):
            w = dequantize(self._raw(e, start, min(rows, start + step)), e.kind).reshape(-1, e.shape[-1])
            w = unpermute_rows(w, e.heads) if e.heads else w
            yield start, np.ascontiguousarray(w, dtype=np.float32)

    def int4(self, name: str, group: int) -> Int4Weight | None:
        """Projection `name` as the int4 codes its GGUF blocks already are (Q4_K, Q4_0, Q4_1, whose values are
        a code times a scale plus an offset per 32 values), where `group` is 32; None where it is not."""
        e = self.entries[name]
        decode = _int4_decoders().get(e.kind)
        if decode is None or group != 32 or len(e.shape) != 2:
            return None
        n, k = e.shape
        codes = torch.empty(n, k, dtype=torch.uint8)
        scale, low = torch.empty(n, k // group), torch.empty(n, k // group)
        for start in range(0, n, ROWS_PER_CHUNK):
            raw = self._raw(e, start, min(n, start + ROWS_PER_CHUNK))
            c, s, lo = decode(raw.reshape(-1, e.block_bytes))
            stop = start + len(raw)
            codes[start:stop] = torch.from_numpy(c.reshape(len(raw), k))
            scale[start:stop] = torch.from_numpy(s.reshape(len(raw), -1))
            low[start:stop] = torch.from_numpy(lo.reshape(len(raw), -1))
        if e.heads:
            codes, scale, low = (unpermute_rows(t, e.heads).contiguous() for t in (codes, scale, low))
        return Int4Weight(codes, scale, low, group, exact=1.0)

    def _raw(self, e: _Entry, start: int, stop: int) -> np.ndarray:
        raw = np.empty((stop - start, e.row_bytes), dtype=np.uint8)
        read_exact(self.file, self.path, raw.nbytes, e.offset + start * e.row_bytes, raw)
        return raw


def gguf_weights_path(model_dir: Path) -> Path | None:
    """The GGUF a converted directory reads its weights from, or None for a directory of safetensors."""
    source = Path(model_dir) / SOURCE_FILE
    if not source.is_file():
        return None
    meta = json.loads(source.read_text())
    if meta.get("weights") != "gguf":
        return None
    path = Path(meta["gguf"])
    if not path.is_file() or path.stat().st_size != meta["gguf_bytes"]:
        raise FileNotFoundError(f"{model_dir} reads its weights from {path} ({meta['gguf_bytes']} bytes), which is "
                                f"{'missing' if not path.is_file() else 'changed'}: resolve the model's source again "
                                f"(or remove {model_dir})")
    return path


def export_safetensors(model_dir: Path) -> Path:
    """Write the fp32 weights of a GGUF-backed directory as model.safetensors beside its config, once, so
    transformers' from_pretrained loads the directory (the engine itself reads the GGUF). A block of rows at a
    time; returns the directory."""
    model_dir = Path(model_dir)
    gguf = gguf_weights_path(model_dir)
    target = model_dir / "model.safetensors"
    if gguf is None or target.is_file():
        return model_dir
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with GGUFWeights(gguf) as weights, \
                progress.step(f"export {model_dir.name} as fp32 safetensors (once; for transformers)",
                              len(weights.keys()), "tensor") as line:
            entries = {name: (torch.float32, list(weights.shape(name))) for name in weights.keys()}
            with SafetensorsWriter(tmp, entries) as writer:
                for name in entries:
                    for _, w in weights.blocks(name):
                        writer.write(name, w)
                    line.update()
        tmp.chmod(0o644)
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return model_dir


def hf_config(gguf_path: Path):
    """The model's transformers config, read from the GGUF's metadata alone (no tensor is dequantized)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = "float32"
    return config


def save_config(gguf_path: Path, out_dir: Path, line) -> bool:
    """config.json and generation_config.json from the GGUF's metadata; returns whether the embeddings are tied
    (the GGUF holds no output.weight), checked against the config."""
    from transformers import GenerationConfig
    line.set_postfix_str("config")
    config = hf_config(gguf_path)
    with GGUFWeights(gguf_path) as weights:
        tied = "lm_head.weight" not in weights.keys()
    if config.tie_word_embeddings != tied:
        raise RuntimeError(f"{gguf_path}: tie_word_embeddings={config.tie_word_embeddings} but output.weight is "
                           f"{'absent' if tied else 'present'}")
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    line.update()
    return tied


def save_tokenizer(gguf_path: Path, out_dir: Path, line) -> None:
    from transformers import AutoTokenizer
    line.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = gguf_chat_template(gguf_path)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    line.set_postfix_str(f"chat template: {'yes' if tokenizer.chat_template else 'no'}")
    line.update()


@contextmanager
def _gguf_metadata_parsed_once():
    """Within the block, transformers parses a GGUF's metadata once per file, over a plain array. For a qwen2 or
    llama file it parses it twice, for the config and again to pick the tokenizer's class, each time building every
    field with gguf's GGUFReader (the vocabulary's 300,000 strings as numpy views): 9 s of CPU per parse for the
    embedded models, on the first start's critical path, two thirds of it numpy's memmap subclass finalizing each
    view (`_plain_reader`). NOTE: a memo of transformers' own loader, its result copied per call; where
    transformers no longer has it, the block changes nothing."""
    try:
        from transformers import modeling_gguf_pytorch_utils as loader
        original = loader.load_gguf_checkpoint
    except (ImportError, AttributeError):
        yield
        return
    parsed = {}

    def once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return original(path, return_tensors=return_tensors, **kwargs)
        if str(path) not in parsed:
            with _plain_reader():
                parsed[str(path)] = original(path, return_tensors=False)
        return copy.deepcopy(parsed[str(path)])

    loader.load_gguf_checkpoint = once
    try:
        yield
    finally:
        loader.load_gguf_checkpoint = original


@contextmanager
def _plain_reader():
    """Within the block, gguf's GGUFReader (which transformers imports at each call) reads a plain ndarray view of
    the file's memory map instead of the np.memmap itself: the same bytes, mapped the same way, but the millions of
    small views a parse takes no longer run memmap's `__array_finalize__` and `__getitem__` in Python. The same
    parsed metadata; 15-21 s -> 5-6 s for the 0.5B's file (2-core AMD EPYC, Zen 3, beside a test run)."""
    import gguf
    import numpy as np

    stock = gguf.GGUFReader

    class PlainReader(stock):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):  # NOTE: the view keeps the memmap, and so the mapping, alive as its base
            self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    gguf.GGUFReader = PlainReader
    try:
        yield
    finally:
        gguf.GGUFReader = stock


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """`out_dir`: the GGUF's config and tokenizer, and a note that its weights are read from `gguf_path`."""
    if (out_dir / "config.json").is_file():
        _drop_fp32_copy(out_dir)
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        with progress.step(f"read config and tokenizer of {gguf_path.name} -> {out_dir} (once; cached)", 2,
                           "part") as line, _gguf_metadata_parsed_once():
            tied = save_config(gguf_path, tmp, line)
            save_tokenizer(gguf_path, tmp, line)
        source = {"gguf": str(gguf_path), "gguf_bytes": gguf_path.stat().st_size, "tie_word_embeddings": tied,
                  "weights": "gguf"}
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        for file in tmp.iterdir():
            file.chmod(0o644)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _drop_fp32_copy(out_dir: Path) -> None:
    """A directory converted before weights were read from the GGUF holds them in fp32 as well: remove that copy
    (it may be written again by export_safetensors) and read the GGUF from now on."""
    source = out_dir / SOURCE_FILE
    if not source.is_file():
        return
    meta = json.loads(source.read_text())
    gguf = Path(meta.get("gguf", ""))
    if meta.get("weights") == "gguf" or not gguf.is_file() or gguf.stat().st_size != meta.get("gguf_bytes"):
        return
    files = list(out_dir.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    meta["weights"] = "gguf"
    tmp = source.with_name(f".{SOURCE_FILE}.tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(source)
    for file in files:
        file.unlink(missing_ok=True)
    if files:
        log(f"{out_dir.name}: weights are read from {gguf.name} now; removed their fp32 copy "
            f"({size / 2**30:.1f} GiB; `export_safetensors` writes it again for transformers)")
