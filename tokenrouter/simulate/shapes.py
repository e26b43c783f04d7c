"""Model shapes: what a step of a model costs in weights, KV cache and FLOPs, from its architecture alone.

A simulation needs no weights: a model's shape comes from a table of public architectures (by the name in its
`source`), from the project's tiny presets (`tiny:NAME`), or from a `config.json` in a local model directory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "int4": 0.5, "auto": 2}


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    max_position: int = 32768

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (attention and MLP projections; norms are negligible)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def num_parameters(self) -> int:
        return self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def streamed_parameters(self) -> int:
        """Weights a step reads in full: every layer and the output projection (the embedding is only gathered)."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def _qwen(name, layers, hidden, intermediate, heads, kv_heads, head_dim=128, vocab=151_936, tied=False,
          max_position=40_960) -> ModelShape:
    return ModelShape(name, layers, hidden, intermediate, heads, kv_heads, head_dim, vocab, tied, max_position)


# Public architectures (each model's config.json on the Hugging Face hub), by the lower-cased last part of a source.
KNOWN: dict[str, ModelShape] = {s.name: s for s in [
    _qwen("qwen3-0.6b", 28, 1024, 3072, 16, 8, tied=True),
    _qwen("qwen3-1.7b", 28, 2048, 6144, 16, 8, tied=True),
    _qwen("qwen3-4b", 36, 2560, 9728, 32, 8, tied=True),
    _qwen("qwen3-8b", 36, 4096, 12288, 32, 8),
    _qwen("qwen3-14b", 40, 5120, 17408, 40, 8),
    _qwen("qwen3-32b", 64, 5120, 25600, 64, 8),
    _qwen("deepseek-r1-distill-qwen-1.5b", 28, 1536, 8960, 12, 2, max_position=131_072),
    _qwen("deepseek-r1-distill-qwen-7b", 28, 3584, 18944, 28, 4, vocab=152_064, max_position=131_072),
    _qwen("deepseek-r1-distill-qwen-14b", 48, 5120, 13824, 40, 8, vocab=152_064, max_position=131_072),
    _qwen("deepseek-r1-distill-qwen-32b", 64, 5120, 27648, 40, 8, vocab=152_064, max_position=131_072),
    _qwen("qwen2.5-coder-0.5b-instruct", 24, 896, 4864, 14, 2, head_dim=64, tied=True, max_position=32_768),
    _qwen("qwen2.5-coder-1.5b-instruct", 28, 1536, 8960, 12, 2, tied=True, max_position=32_768),
]}
# the GPU check's random models of Qwen3's shapes (tiny:qwen3-0.6b-shape) are those shapes
KNOWN["qwen3-0.6b-shape"], KNOWN["qwen3-8b-shape"] = KNOWN["qwen3-0.6b"], KNOWN["qwen3-8b"]


def shape_of(source: str) -> ModelShape:
    """The shape of a config's model `source`: a known architecture, a tiny preset, or a local config.json."""
    key = source.rsplit("/", 1)[-1].split(":", 1)[-1].lower()
    if key in KNOWN:
        return KNOWN[key]
    if source.startswith("tiny:"):
        from tokenrouter.models.tiny import hf_config

        return from_hf_config(hf_config(source.removeprefix("tiny:")).to_dict(), key)
    path = Path(source).expanduser()
    if (path / "config.json").exists():
        return from_hf_config(json.loads((path / "config.json").read_text()), path.name.lower())
    raise ValueError(f"source: no shape known for {source!r}; known: {sorted(KNOWN)}, tiny:NAME, or a local "
                     "directory with a config.json")


def from_hf_config(cfg: dict, name: str) -> ModelShape:
    heads = cfg["num_attention_heads"]
    return ModelShape(name, cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], heads,
                      cfg.get("num_key_value_heads") or heads, cfg.get("head_dim") or cfg["hidden_size"] // heads,
                      cfg["vocab_size"], bool(cfg.get("tie_word_embeddings", False)),
                      cfg.get("max_position_embeddings", 32768))
