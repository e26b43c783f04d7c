"""One lean decoder for the Llama, Qwen2 and Qwen3 families, running on a paged KV cache.

The families differ only in flags: Qwen2 has biases on q/k/v, Qwen3 normalises q and k per head.
Projections are fused (qkv, gate_up) so each layer streams four weight matrices.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tokenrouter.bench import progress
from tokenrouter.models.attention import AttentionBackend, AttentionMetadata, store_kv
from tokenrouter.models.attention.torch_backend import TorchBackend
from tokenrouter.models.layers import Linear, RMSNorm, RotaryEmbedding, apply_rotary
from tokenrouter.models.parallel import TensorParallel
from tokenrouter.models.safetensors_io import SafetensorsReader

SINGLE = TensorParallel(0, 1)
# NOTE: the largest gate_up output a CPU step makes at once (MLP.slice_rows). glibc's malloc hands a block of over
# 32 MiB back to the kernel when it is freed (a thread's arena cannot hold one of over 64 MiB at all), so a long
# chunk's MLP faulted its intermediates in again, zeroed, at every layer: a 2,048-token prefill of the 1.5B in chunks
# of 1,024 tokens (gate_up 73 MB, silu 37 MB a layer) took 1.5 million page faults (5.8 GiB). In slices, on a
# thread of its own as the engine steps, best of 3: 2,048 tokens 12.7 -> 8.6-9.7 s, 1,024 tokens 6.4 -> 3.8-4.0 s;
# the 0.5B 7.8 -> 5.5-6.3 s and 3.7 -> 2.3-2.9 s (AMD EPYC Zen 5, two threads, 2026-12-07). Smaller blocks are
# reused from the heap.
MLP_SLICE_BYTES = 24 << 20

FAMILIES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(slots=True)
class DecoderConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, hf: dict) -> DecoderConfig:
        arch = (hf.get("architectures") or ["?"])[0]
        if arch not in FAMILIES:
            raise ValueError(f"architectures={arch!r} is not supported; supported: {sorted(FAMILIES)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (silu is)")
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported")
        family = FAMILIES[arch]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        heads = hf["num_attention_heads"]
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf["rms_norm_eps"],
            rope_theta=float(theta),
            rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
            qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> DecoderConfig:
        return cls.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        # this rank's heads and KV heads (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        self.tp = tp
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)  # row-parallel: its output is summed over ranks
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5
        self.backend: AttentionBackend = TorchBackend()
        self.ops = None  # the cpu-ops module (DecoderLM.use_cpu_ops)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [N, hidden]; q and k are adjacent in qkv, so one rotation covers both
        n = x.shape[0]
        qkv = self.qkv_proj(x).view(n, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        if self.ops is not None and qk.dtype == torch.float32:  # NOTE: qk is this step's own: rotated in place
            self.ops.rope_store_(qk, v, *rope, kv[0], kv[1], meta.slot_mapping)
            q = qk[:, :self.num_heads]
        else:
            q, k = apply_rotary(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
            store_kv(kv[0], kv[1], k, v, meta.slot_mapping)
        out = self.backend.forward(q, kv[0], kv[1], meta, self.scale)  # [N, Hq, D]
        return self.tp.all_reduce(self.o_proj(out.reshape(n, self.q_size)))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        inter = cfg.intermediate_size // tp.size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter)
        self.down_proj = Linear(inter, cfg.hidden_size)  # row-parallel
        self.tp = tp
        self.ops = None  # the cpu-ops module (DecoderLM.use_cpu_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, hidden]
        slices = -(-x.shape[0] // self.slice_rows(x))
        if slices == 1:
            return self.tp.all_reduce(self.rows(x))
        return self.tp.all_reduce(torch.cat([self.rows(part) for part in x.tensor_split(slices)]))

    def slice_rows(self, x: torch.Tensor) -> int:
        """How many rows of x the MLP takes at once: on a CPU, as many as keep gate_up's output [rows, 2 * inter]
        within MLP_SLICE_BYTES; elsewhere all of them. Our int4 and int8 kernels give each row the same floats in any
        slice; torch's GEMMs may round a row differently by the number of rows, as batching does."""
        if x.device.type != "cpu":
            return max(1, x.shape[0])
        return max(1, MLP_SLICE_BYTES // (self.gate_up_proj.out_features * 4))

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None and gate_up.dtype == torch.float32:
            return self.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x, rope, kv, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, delta, rope, kv, meta, ops):
        """forward with the residual adds inside the norms (cpu-ops): the layer's input is x + delta (delta None on
        the first layer); returns (x', delta') whose sum is forward's output."""
        norm = self.input_layernorm
        if delta is None:
            h = ops.rms_norm(x, norm.weight, norm.eps)
        else:
            x, h = ops.add_rms_norm(x, delta, norm.weight, norm.eps)
        norm = self.post_attention_layernorm
        x, h = ops.add_rms_norm(x, self.self_attn(h, rope, kv, meta), norm.weight, norm.eps)
        return x, self.mlp(h)


class DecoderLM(nn.Module):
    def __init__(self, cfg: DecoderConfig, max_positions: int, tp: TensorParallel = SINGLE):
        super().__init__()
        tp.split(cfg.num_heads, "num_attention_heads")
        tp.split(cfg.num_kv_heads, "num_key_value_heads")
        tp.split(cfg.intermediate_size, "intermediate_size")
        self.cfg, self.tp = cfg, tp
        self.source = ""  # the weights' directory name, set by load_weights (names the model in start-up lines)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self._views: tuple[torch.Tensor, list] | None = None  # (KV pool, its per-layer views): _layer_views
        self.ops = None  # the cpu-ops module, where use_cpu_ops gave it
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def weight_bytes(self) -> int:
        """Bytes of weights held: the parameters left dense plus what each projection's kernel holds."""
        dense = sum(p.numel() * p.element_size() for p in self.parameters())
        return dense + sum(m.kernel.nbytes for m in self.modules() if isinstance(m, Linear) and m.kernel is not None)

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        for layer in self.layers:
            layer.self_attn.backend = backend

    def use_cpu_ops(self, ops) -> None:
        """Run the small operations between the projections (norms with their residual adds, SiLU, rotary and the
        cache write) as one C++ call each (tokenrouter.models.native.cpu_ops(); None: torch's ops), for fp32
        activations on a CPU."""
        self.ops = ops
        for layer in self.layers:
            layer.self_attn.ops = layer.mlp.ops = ops

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions: [N]; kv_cache: [layers, 2, blocks, block_size, Hkv, D] -> hidden [N, hidden]
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        ops = self.ops
        if ops is not None and x.dtype == torch.float32:
            delta = None
            for layer, kv in zip(self.layers, self._layer_views(kv_cache)):
                x, delta = layer.forward_fused(x, delta, rope, kv, meta, ops)
            return ops.add_rms_norm(x, delta, self.norm.weight, self.norm.eps)[1]
        for layer, kv in zip(self.layers, self._layer_views(kv_cache)):
            x = layer(x, rope, kv, meta)
        return self.norm(x)

    def _layer_views(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (keys, values) views of `kv_cache`, made once per pool rather than four ops a layer a step.
        NOTE: kept for the last pool seen (the runner's; a profile's or a graph's pool replaces them)."""
        if self._views is None or self._views[0] is not kv_cache:
            self._views = (kv_cache, [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(len(self.layers))])
        return self._views[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [M, hidden] -> [M, vocab], float32
        return self.lm_head(hidden).float()


def _hf_targets(name: str) -> tuple[str, int, int] | None:
    """Map an HF weight name to (our parameter, index of the shard, number of shards) for fused weights."""
    for shard, part in enumerate(("q_proj", "k_proj", "v_proj")):
        if f".self_attn.{part}." in name:
            return name.replace(part, "qkv_proj"), shard, 3
    for shard, part in enumerate(("gate_proj", "up_proj")):
        if f".mlp.{part}." in name:
            return name.replace(part, "gate_up_proj"), shard, 2
    return None


def weight_files(model_dir: Path) -> list[Path]:
    """The files a model directory's weights are read from: the GGUF it was converted from (tokenrouter's
    converted directories hold no weights of their own), else its safetensors."""
    from tokenrouter.models.gguf_convert import gguf_weights_path
    gguf = gguf_weights_path(model_dir)
    files = [gguf] if gguf is not None else sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def open_weights(file: Path):
    """A reader of one weight file (SafetensorsReader's interface: keys(), read(name, out), int4(name, group))."""
    if file.suffix == ".gguf":
        from tokenrouter.models.gguf_convert import GGUFWeights
        return GGUFWeights(file)
    return SafetensorsReader(file)


@dataclass(frozen=True, slots=True)
class WeightTensor:
    """One tensor of a model directory, and where it goes: all of `target`, or its rows of shard `shard` of
    `shards` (q / k / v of the fused qkv, gate / up of gate_up)."""
    reader: object
    key: str  # its name in the file (Hugging Face's)
    name: str  # its name in the model before fusing (for tensor-parallel slicing)
    target: str  # the model's parameter
    shard: int
    shards: int


def weight_tensors(model: DecoderLM, model_dir: Path, what: str) -> Iterator[WeightTensor]:
    """Every tensor of `model_dir` that `model` uses, file by file, behind a progress line of `what`."""
    model.source = Path(model_dir).name
    with ExitStack() as stack:
        readers = [stack.enter_context(open_weights(file)) for file in weight_files(model_dir)]
        with progress.step(f"{what} {model.source}", sum(len(r.keys()) for r in readers), "tensor") as line:
            for reader in readers:
                for key in reader.keys():
                    name = key.removeprefix("model.")
                    if not (name == "lm_head.weight" and model.cfg.tie_word_embeddings):
                        target, shard, shards = _hf_targets(name) or (name, 0, 1)
                        yield WeightTensor(reader, key, name, target, shard, shards)
                    line.update()


@torch.no_grad()
def load_weights(model: DecoderLM, model_dir: Path, skip: frozenset[str] = frozenset(), what: str = "load") -> None:
    """Copy the weights of `model_dir` into `model`'s parameters, one tensor at a time; `skip`: parameters left
    unread (projections whose codes come from elsewhere: tokenrouter/models/prepare.py)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tp = model.tp
    seen: set[str] = set()
    for t in weight_tensors(model, model_dir, what):
        if t.target in skip:
            continue
        if params.get(t.target) is None:
            raise KeyError(f"{model_dir}: unexpected weight {t.key!r}" if t.target not in params else
                           f"{model_dir}: {t.key!r} again, after {t.target} was complete")
        dest = params[t.target].detach()
        if t.shards > 1:
            offset, size = shard_rows(model.cfg, tp, t.target, t.shard)
            dest = dest.narrow(0, offset, size)
        # NOTE: unsharded, a weight is read straight into its parameter (or its rows of a fused one)
        tensor = t.reader.read(t.key, dest if tp.size == 1 else None)
        if tensor is not dest:
            dest.copy_(rank_part(t.name, tensor, tp))
        del tensor, dest
        seen.add(t.target if t.shards == 1 else f"{t.target}#{t.shard}")
        if t.shards == 1 or all(f"{t.target}#{i}" in seen for i in range(t.shards)):
            params[t.target] = None
    expected = {n for n in params if _is_plain(n)} | {f"{n}#{s}" for n in params for s in _shards(n)}
    if model.cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(n for n in expected - seen if n.partition("#")[0] not in skip)
    if missing:
        raise KeyError(f"{model_dir}: weights missing for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def shard_rows(cfg: DecoderConfig, tp: TensorParallel, target: str, shard: int) -> tuple[int, int]:
    """(first row, rows) of shard `shard` in fused parameter `target` (this rank's part of each)."""
    if "qkv" in target:
        q, kv = cfg.num_heads * cfg.head_dim // tp.size, cfg.num_kv_heads * cfg.head_dim // tp.size
        sizes = [q, kv, kv]
    else:
        sizes = [cfg.intermediate_size // tp.size] * 2
    return sum(sizes[:shard]), sizes[shard]


COLUMN_PARALLEL = (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj.", ".mlp.gate_proj.", ".mlp.up_proj.")
ROW_PARALLEL = (".self_attn.o_proj.", ".mlp.down_proj.")


def rank_part(name: str, tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of an HF weight: output rows of a column-parallel projection (its heads, its MLP
    slice), input columns of a row-parallel one; everything else whole."""
    if tp.size == 1:
        return tensor
    if any(part in name for part in COLUMN_PARALLEL):
        offset, n = tp.split(tensor.shape[0], name)
        return tensor.narrow(0, offset, n)
    if any(part in name for part in ROW_PARALLEL) and tensor.dim() == 2:
        offset, n = tp.split(tensor.shape[1], name)
        return tensor.narrow(1, offset, n)
    return tensor


def _is_plain(name: str) -> bool:
    return "qkv_proj" not in name and "gate_up_proj" not in name


def _shards(name: str) -> range:
    return range(3) if "qkv_proj" in name else range(2) if "gate_up_proj" in name else range(0)
