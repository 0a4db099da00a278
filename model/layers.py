"""Token-wise layers: RMSNorm, rotary embeddings with per-sample positions (Rotary), top-k MoE."""

from __future__ import annotations

import itertools
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


class Rotary:
    """Rotary cos/sin of a step's token positions, gathered from a per-process table of every
    position so far (computed in float64 once, grown by doubling) and cast once per dtype: no
    trigonometry in the step, none in the layers."""

    _tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __init__(self, positions: torch.Tensor, head_dim: int, theta: float, ranges: list[tuple[int, int]] | None = None):
        """ranges: the positions as (start, stop) runs, when known (a rank's chunks of its samples):
        the step's tables are then copies of table slices rather than a gather."""
        self.positions, self.ranges, self.theta = positions, ranges, float(theta)
        self.half, self.d = head_dim // 2, head_dim
        if ranges is not None:
            self.n = max((b for _, b in ranges), default=1)
        else:
            self.n = int(positions.max()) + 1 if positions.numel() else 1
        self._step: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def _table(cls, n: int, head_dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [>= n, head_dim / 2] of positions 0.. in `dtype` (computed in float64)."""
        key = (head_dim, theta, str(device), dtype)
        have = cls._tables.get(key)
        if have is None or have[0].shape[0] < n:
            size = max(1024, 1 << (n - 1).bit_length())
            half = head_dim // 2
            inv = 1.0 / (theta ** (torch.arange(0, half, device=device, dtype=torch.float64) / half))
            ang = torch.arange(size, device=device, dtype=torch.float64)[:, None] * inv[None, :]
            cls._tables[key] = have = (ang.cos().to(dtype), ang.sin().to(dtype))
        return have

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim / 2] of this step's positions in `dtype` (made on first use)."""
        if dtype not in self._step:
            cos, sin = self._table(self.n, self.d, self.theta, self.positions.device, dtype)
            if self.ranges is not None and self.ranges:
                cos, sin = (torch.cat([t[a:b] for a, b in self.ranges]) for t in (cos, sin))
            else:
                cos, sin = cos[self.positions], sin[self.positions]
            self._step[dtype] = (cos[:, None, :], sin[:, None, :])
        return self._step[dtype]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] -> x rotated by each token's position."""
        cos, sin = self.tables(x.dtype)
        h = self.half
        x1, x2 = x[..., :h], x[..., h : 2 * h]
        rot = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return torch.cat([rot, x[..., 2 * h :]], dim=-1) if self.d % 2 else rot


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
        n_experts = self.w1.shape[0]
        # dispatch by one stable sort: each expert's (token, slot) pairs are contiguous, in token
        # order; one host sync per layer (the per-expert counts that size the GEMMs)
        flat = expert.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n_experts)
        tok = order // self.top_k
        xs = x[tok]
        ys = []
        for e, (a, b) in enumerate(_spans(counts.tolist())):
            if b > a:
                xe = xs[a:b]
                ys.append((F.silu(xe @ self.w1[e]) * (xe @ self.w3[e])) @ self.w2[e])
        if not ys:  # no token here: an empty product keeps the experts in the graph (zero gradients),
            xe = xs[:0]  # so every rank reduces the same parameters (FSDP2 reduce-scatters those with a gradient)
            ys.append((F.silu(xe @ self.w1[0]) * (xe @ self.w3[0])) @ self.w2[0])
        y = torch.cat(ys)
        # combined in the residual stream's dtype (under autocast the experts' outputs are bf16, the stream fp32)
        out = x.new_zeros(x.shape).index_add_(0, tok, (y * weight.reshape(-1)[order, None]).to(x.dtype))
        counts = counts.to(x.dtype)
        mass = probs.sum(0)
        if reduce is not None:
            counts, mass = reduce(counts.detach()), reduce(mass)
        n = total_tokens if total_tokens is not None else x.shape[0]
        aux = probs.shape[-1] * ((counts / (n * self.top_k)) * (mass / n)).sum() if n else x.sum() * 0
        return out, aux


def _spans(counts: list[int]) -> list[tuple[int, int]]:
    """[a, b) of each expert's rows in the sorted dispatch order."""
    ends = list(itertools.accumulate(counts))
    return [(e - c, e) for c, e in zip(counts, ends)]
