"""The trained routers' network and its inputs, shared by training and the policies that load it.

neural (R2R): the small model's last hidden state, the input embedding of the token it samples and its
top-k log-probabilities, each standardised and projected, fused, residual MLP blocks, one logit.
probe / query (CITER, Co-LLM deferral probes; query-level classifier): the hidden state alone, linear
(dim 0) or a small MLP."""
from __future__ import annotations

import torch
from torch import nn

FEATURES = {
    "neural": ("hidden", "token_embedding", "topk_logprobs"),
    "probe": ("hidden",),
    "query": ("hidden",),
}


def topk_logprobs(logits: torch.Tensor, k: int) -> torch.Tensor:
    # logits: [B, vocab] -> [B, k] sorted descending
    return torch.log_softmax(logits.float(), -1).topk(k, -1).values


class Residual(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class RouterNet(nn.Module):
    def __init__(self, inputs: dict[str, int], dim: int = 0, blocks: int = 0):
        super().__init__()
        self.inputs, self.dim, self.blocks = dict(inputs), dim, blocks
        for name, size in inputs.items():
            self.register_buffer(f"{name}_mean", torch.zeros(size))
            self.register_buffer(f"{name}_std", torch.ones(size))
        if dim == 0:
            self.head = nn.Linear(sum(inputs.values()), 1)
        else:
            self.proj = nn.ModuleDict({name: nn.Linear(size, dim) for name, size in inputs.items()})
            self.fuse = nn.Linear(len(inputs) * dim, dim)
            self.body = nn.Sequential(*(Residual(dim) for _ in range(blocks)))
            self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 1))

    def config(self) -> dict:
        return {"inputs": self.inputs, "dim": self.dim, "blocks": self.blocks}

    def standardise_from(self, features: dict[str, torch.Tensor]) -> None:
        for name in self.inputs:
            x = features[name].float()
            getattr(self, f"{name}_mean").copy_(x.mean(0))
            getattr(self, f"{name}_std").copy_(x.std(0).clamp_min(1e-4))

    def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:  # -> [B] logits
        xs = [(features[n].float() - getattr(self, f"{n}_mean")) / getattr(self, f"{n}_std") for n in self.inputs]
        if self.dim == 0:
            return self.head(torch.cat(xs, -1)).squeeze(-1)
        x = self.fuse(torch.cat([nn.functional.gelu(self.proj[n](x)) for n, x in zip(self.inputs, xs)], -1))
        return self.head(self.body(x)).squeeze(-1)
