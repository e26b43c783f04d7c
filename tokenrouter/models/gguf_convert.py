from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from tokenrouter.bench import progress


def gguf_chat_template(gguf_path: Path) -> str | None:
    from gguf import GGUFReader
    field = GGUFReader(gguf_path).get_field("tokenizer.chat_template")
    return field.contents() if field is not None else None


def safetensors_keys(model_dir: Path) -> set[str]:
    from safetensors import safe_open
    keys: set[str] = set()
    for file in model_dir.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            keys.update(f.keys())
    return keys


def save_model(gguf_path: Path, out_dir: Path, line) -> bool:
    import torch
    from transformers import AutoModelForCausalLM
    line.set_postfix_str("dequantizing to fp32 (transformers)")
    model, info = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                       dtype=torch.float32, output_loading_info=True)
    if info["missing_keys"] or info["mismatched_keys"]:
        raise RuntimeError(f"{gguf_path} did not fill every weight: {info}")
    line.update()
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    line.set_postfix_str(f"saving {model.num_parameters() / 1e6:.0f}M parameters as safetensors")
    model.save_pretrained(out_dir)
    line.update()
    return bool(model.config.get_text_config().tie_word_embeddings)


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
