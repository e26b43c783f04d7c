"""Tiny random models of each family, with a byte-level tokenizer the project builds itself.

`tiny:NAME` sources are built once, deterministically from a seed, into the cache as ordinary Hugging
Face directories, so the whole loading path is the same as for real weights.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

_COMMON = dict(vocab_size=VOCAB_SIZE, rms_norm_eps=1e-6, max_position_embeddings=1024, initializer_range=0.2,
               bos_token_id=256, eos_token_id=258, pad_token_id=256)
PRESETS: dict[str, dict] = {
    "llama": dict(family="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, seed=1),
    "qwen2": dict(family="qwen2", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, seed=2),
    "qwen3": dict(family="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=32,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, seed=3),
    "qwen2-small": dict(family="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, seed=10),
    "qwen2-large": dict(family="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False, seed=11),
    # Qwen3-0.6B's and Qwen3-8B's shapes, random, stored in bfloat16: a GPU check of speed and memory that needs no
    # downloaded weights (tests/gpu/run.sh). The vocabulary is Qwen3's 151,936 rows, so the embedding and lm_head
    # cost what they cost in the real models; the byte tokenizer writes ids below 259 and decodes no others.
    "qwen3-0.6b-shape": dict(family="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                             head_dim=128, num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
                             max_position_embeddings=8192, initializer_range=0.02, seed=20, dtype="bfloat16",
                             vocab_size=151_936),
    "qwen3-8b-shape": dict(family="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                           head_dim=128, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                           max_position_embeddings=8192, initializer_range=0.02, seed=21, dtype="bfloat16",
                           vocab_size=151_936),
}


def hf_config(name: str):
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown tiny model {name!r}; known: {sorted(PRESETS)}")
    preset = {**_COMMON, **PRESETS[name]}
    family, _, _ = preset.pop("family"), preset.pop("seed"), preset.pop("dtype", None)
    return AutoConfig.for_model(family, **preset)


def build_tiny_model_dir(name: str) -> Path:
    """Return the directory of tiny model `name`, building it (random weights, fixed seed) if needed."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenrouter.models.sources import cache_dir

    config = hf_config(name)
    digest = hashlib.sha256(json.dumps({**PRESETS[name], **_COMMON}, sort_keys=True).encode()).hexdigest()[:12]
    out = cache_dir() / "tiny" / f"{name}-{digest}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    try:
        torch.manual_seed(PRESETS[name]["seed"])
        dtype = getattr(torch, PRESETS[name].get("dtype", "float32"))
        # NOTE: the GPU-sized presets (bf16) are drawn on the GPU where there is one: on the lent H200 machine's CPU
        # transformers' init of the 8B-shaped model ran for over 5 minutes without finishing (2026-12-04).
        device = "cuda" if name.endswith("-shape") and torch.cuda.is_available() else "cpu"
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.save_pretrained(tmp)
        byte_tokenizer().save_pretrained(tmp)
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").exists():  # a concurrent builder did not win the rename either
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def byte_tokenizer():
    """A byte-level tokenizer: ids 0..255 are bytes, then the ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)  # ids 256, 257, 258 in this order
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[2],
                                   pad_token=SPECIAL_TOKENS[0], additional_special_tokens=SPECIAL_TOKENS[1:2])
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    # The GPT-2 byte-to-printable-character map that ByteLevel pre-tokenization uses.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
