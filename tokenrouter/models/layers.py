"""Building blocks shared by the decoder families: linear, RMSNorm, rotary embedding."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """A projection: dense on load; on CPU `prepare` hands its weight to one kernel of tokenrouter.models.kernels
    (oneDNN packed, int8, int4, ...) and drops the dense copy."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # NOTE: torch.empty leaves the pages untouched: a projection quantized as it loads is never resident in fp32
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernel = None

    def prepare(self, kernel) -> None:
        self.kernel = kernel
        self.drop_weight()
        self.bias = None  # the kernel holds it

    def drop_weight(self) -> None:
        """Free the dense weight (its kernel, or its quantized codes, hold what is needed of it)."""
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self.bias)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether projections on `device` in `dtype` can take a CPU kernel (oneDNN's packed GEMM among them)."""
    from tokenrouter.models.kernels import has_onednn
    return device.type == "cpu" and has_onednn(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op instead of six: fewer dispatches per decode step
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
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
        cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1) * attention_factor
        sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1) * attention_factor
        self.register_buffer("cos_sin", torch.stack((cos, sin), dim=1)[:, :, None], persistent=False)  # [P, 2, 1, D]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [N] -> cos, sin: [N, 1, D], looked up once per step for every layer (one gather for both)
        return self.cos_sin[positions].unbind(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, H, D]; cos, sin: [N, 1, D] from RotaryEmbedding
    # NOTE: in fp32 (a half-precision x promotes against the fp32 table), two ops besides the swap; rolling by half
    # the head swaps its halves in one op
    swapped = x.roll(x.shape[-1] // 2, -1)
    out = torch.addcmul(x * cos, swapped, sin)
    return out if out.dtype == x.dtype else out.to(x.dtype)


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
