"""Token-wise layers: RMSNorm, rotary embeddings with per-sample positions, top-k MoE."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, dim] -> [T, dim]"""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x [T, H, D] by each token's position inside its own sample (positions [T]).

    >>> apply_rotary(torch.randn(3, 2, 4), torch.tensor([0, 1, 0]), 1e4).shape
    torch.Size([3, 2, 4])
    """
    d = x.shape[-1]
    half = d // 2
    inv = 1.0 / (theta ** (torch.arange(0, half, device=x.device, dtype=torch.float64) / half))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rot = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return torch.cat([rot, x[..., 2 * half :]], dim=-1) if d % 2 else rot


Reduce = Callable[[torch.Tensor], torch.Tensor]


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with an optional load-balancing auxiliary loss.

    The auxiliary loss uses per-expert sums over the *global* batch (`reduce` all-reduces them in
    a distributed step), so it does not depend on how tokens are laid out over ranks.
    """

    def __init__(self, hidden: int, ffn: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(n_experts, hidden, ffn) / hidden**0.5)
        self.w3 = nn.Parameter(torch.randn(n_experts, hidden, ffn) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, ffn, hidden) / ffn**0.5)

    def forward(self, x: torch.Tensor, reduce: Reduce | None = None, total_tokens: int | None = None):
        """x [T, hidden] -> ([T, hidden], aux_loss scalar)."""
        probs = torch.softmax(self.router(x), dim=-1)
        weight, expert = probs.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            tok, slot = (expert == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = x[tok]
            ye = (F.silu(xe @ self.w1[e]) * (xe @ self.w3[e])) @ self.w2[e]
            out = out.index_add(0, tok, ye * weight[tok, slot, None])
        counts = F.one_hot(expert, probs.shape[-1]).sum((0, 1)).to(x.dtype)
        mass = probs.sum(0)
        if reduce is not None:
            counts, mass = reduce(counts.detach()), reduce(mass)
        n = total_tokens if total_tokens is not None else x.shape[0]
        aux = probs.shape[-1] * ((counts / (n * self.top_k)) * (mass / n)).sum() if n else x.sum() * 0
        return out, aux
