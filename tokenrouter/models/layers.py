"""Building blocks shared by the decoder families: linear, RMSNorm, rotary embedding."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [N, in], weight: [out, in] -> [N, out]
    # NOTE: on CPU, MKL's small-row GEMM behind F.linear runs far below memory bandwidth; W @ x.T with
    # at least two columns streams the weight 2-3x faster (measured in ../shared/MODELS.md and by
    # `python -m tokenrouter.bench runner`). A single row is padded to two: gemv is the slow case too.
    n = x.shape[0]
    if x.device.type != "cpu" or n > SMALL_ROWS:
        return F.linear(x, weight, bias)
    x = x.contiguous() if n > 1 else x.expand(2, -1).contiguous()
    out = (weight @ x.T)[:, :n].T.contiguous()
    return out + bias if bias is not None else out


SMALL_ROWS = 16


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Reorder the weight into oneDNN's blocked layout and drop the dense copy (CPU only)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), SMALL_ROWS)
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return linear(x, self.weight, self.bias)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    # NOTE: oneDNN's packed fp32 GEMM streams weights 2-4x faster than MKL's small-row GEMM on this
    # project's CPUs (AMD EPYC: MKL takes a slow path; `python -m tokenrouter.bench runner` shows both).
    # Its bf16 GEMM, on CPUs with AVX512-BF16 or AMX, is about 2x faster again (half the bytes, twice the FLOPs).
    if not (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding with the cos/sin table precomputed for every position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        inv_freq, attention_factor = _scale_inv_freq(inv_freq, scaling or {})
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # NOTE: sin carries rotate-half's sign (-sin, +sin), so rotating is x * cos + swap_halves(x) * sin.
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), dim=-1) * attention_factor,
                             persistent=False)
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1) * attention_factor,
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [N] -> cos, sin: [N, 1, D], looked up once per step for every layer
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, H, D]; cos, sin: [N, 1, D] from RotaryEmbedding
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return (x.float() * cos + swapped.float() * sin).to(x.dtype)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> tuple[torch.Tensor, float]:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, out), 1.0
    raise NotImplementedError(f"rope_scaling.rope_type={kind!r} is not supported (default, linear, llama3 are)")
