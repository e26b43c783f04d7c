from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from tokenrouter.bench import progress
from tokenrouter.models.safetensors_io import SafetensorsReader, SafetensorsWriter


def gguf_chat_template(gguf_path: Path) -> str | None:
    from gguf import GGUFReader
    field = GGUFReader(gguf_path).get_field("tokenizer.chat_template")
    return field.contents() if field is not None else None


def safetensors_keys(model_dir: Path) -> set[str]:
    keys: set[str] = set()
    for file in model_dir.glob("*.safetensors"):
        with SafetensorsReader(file) as f:
            keys.update(f.keys())
    return keys


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
    transformers' GGUF loader does), so rotate-half rotary applies."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config(gguf_path: Path):
    """The model's transformers config, read from the GGUF's metadata alone (no tensor is dequantized)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = "float32"
    return config


def save_model(gguf_path: Path, out_dir: Path, line) -> bool:
    """Dequantize the GGUF's tensors to fp32 safetensors one block of rows at a time: the conversion holds a few
    MB besides the memory-mapped GGUF (transformers' loader held the whole fp32 model twice: 9.1 GB for the 1.5B)."""
    import numpy as np
    import torch
    from gguf import GGUFReader, GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers import GenerationConfig

    line.set_postfix_str("config")
    config = hf_config(gguf_path)
    reader = GGUFReader(gguf_path)
    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        if name in tensors:
            raise RuntimeError(f"{gguf_path}: two tensors map to {name}")
        tensors[name] = t
    tied = "lm_head.weight" not in tensors
    if config.tie_word_embeddings != tied:
        raise RuntimeError(f"{gguf_path}: tie_word_embeddings={config.tie_word_embeddings} but output.weight is "
                           f"{'absent' if tied else 'present'}")
    llama = config.model_type == "llama"
    entries = {name: (torch.float32, [int(n) for n in reversed(t.shape.tolist())]) for name, t in tensors.items()}
    with SafetensorsWriter(out_dir / "model.safetensors", entries) as writer:
        for i, (name, t) in enumerate(tensors.items()):
            line.set_postfix_str(f"dequantizing to fp32: tensor {i + 1}/{len(tensors)}")
            heads = (config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
                     if ".k_proj." in name else 0) if llama else 0
            rows = len(t.data) if t.data.ndim > 1 else 1
            step = rows if heads else ROWS_PER_CHUNK  # a permuted projection moves rows across chunks: whole
            for start in range(0, rows, step):
                block = t.data[start:start + step] if t.data.ndim > 1 else t.data
                w = np.ascontiguousarray(dequantize(block, GGMLQuantizationType(t.tensor_type)), dtype=np.float32)
                writer.write(name, unpermute_rows(w, heads) if heads else w)
    line.update()
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


def check_lm_head(out_dir: Path, tied: bool) -> None:
    if not tied and "lm_head.weight" not in safetensors_keys(out_dir):
        raise RuntimeError(f"{out_dir} has tie_word_embeddings=false but its safetensors hold no lm_head.weight")


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        with progress.step(f"convert {gguf_path.name} -> {out_dir} (once; cached)", 3, "part") as line:
            tied = save_model(gguf_path, tmp, line)
            save_tokenizer(gguf_path, tmp, line)
        check_lm_head(tmp, tied)
        source = {"gguf": str(gguf_path), "gguf_bytes": gguf_path.stat().st_size, "tie_word_embeddings": tied}
        (tmp / "tokenrouter_source.json").write_text(json.dumps(source, indent=2) + "\n")
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
