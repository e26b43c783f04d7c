from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFoundError(FileNotFoundError):

    def __init__(self, source: str, looked: list[str], fix: str):
        self.source = source
        self.looked = looked
        self.fix = fix
        places = "\n".join(f"  - {place}" for place in looked)
        super().__init__(f"model {source!r} not found. Looked in:\n{places}\nTo fix: {fix}")


def log(message: str) -> None:
    print(f"[tokenrouter] {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    if path := os.environ.get("TOKENROUTER_CACHE"):
        return Path(path).expanduser()
    if path := os.environ.get("XDG_CACHE_HOME"):
        return Path(path).expanduser() / "tokenrouter"
    return Path.home() / ".cache" / "tokenrouter"


def hf_hub_cache() -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if path := os.environ.get(var):
            return Path(path).expanduser()
    if path := os.environ.get("HF_HOME"):
        return Path(path).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def resolve_model_dir(source: str) -> Path:
    if source.startswith("tiny:"):
        from tokenrouter.models.tiny import build_tiny_model_dir
        return build_tiny_model_dir(source.removeprefix("tiny:"))
    if source.startswith("embedded:"):
        from tokenrouter.models.embedded import prepare_embedded
        return prepare_embedded(source.removeprefix("embedded:"))
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return resolve_gguf_file(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(source, [f"{path}/config.json (directory has no config.json)"],
                                     "pass a Hugging Face model directory, a .gguf file, or an embedded: name")
        return path
    if path.suffix == ".gguf" or path.is_absolute() or source.startswith(".") or not HUB_ID.match(source):
        raise ModelNotFoundError(source, [str(path.absolute())],
                                 "check the path, or pass embedded:qwen2.5-coder-0.5b-instruct")
    return resolve_hub_id(source, path.absolute())


def transformers_model(model_dir: Path, dtype):
    """transformers' model of `model_dir`, the reference the runner is checked against, in eval mode; a directory
    converted from a GGUF (whose weights the engine reads from the GGUF) gets its fp32 safetensors written first,
    once."""
    from transformers import AutoModelForCausalLM

    from tokenrouter.models.gguf_convert import export_safetensors
    return AutoModelForCausalLM.from_pretrained(export_safetensors(model_dir), dtype=dtype).eval()


def resolve_gguf_file(path: Path) -> Path:
    from tokenrouter.models.gguf_convert import convert_gguf
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return convert_gguf(path, cache_dir() / "hf" / f"gguf-{path.stem}-{key}")


def resolve_hub_id(repo_id: str, local_path: Path) -> Path:
    from huggingface_hub import snapshot_download
    hub_cache = hf_hub_cache()
    repo_dir = hub_cache / f"models--{repo_id.replace('/', '--')}"
    try:
        path = Path(snapshot_download(repo_id, cache_dir=hub_cache, local_files_only=True))
    except OSError:
        path = None
    if path is None or not (path / "config.json").is_file():
        looked = [f"local directory {local_path}", f"Hugging Face hub cache {repo_dir} (never downloaded at run time)"]
        raise ModelNotFoundError(repo_id, looked, f"run: hf download {repo_id}   (or: huggingface-cli download {repo_id})")
    return path
