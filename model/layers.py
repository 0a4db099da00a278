"""Token-wise layers: RMSNorm, rotary embeddings with per-sample positions (Rotary), top-k MoE."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .experts import Experts, gather_slots, inverse_permutation, permute_rows


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
    a distributed step), so it does not depend on how tokens are laid out over ranks, nor on the
    expert-parallel degree. A token's slots are sorted by expert (a stable sort: token order
    within an expert), run by the rank's own experts or, given a model.experts.ExpertDispatch, by
    the ranks of its expert-parallel group, and summed back weighted in slot order.
    """

    def __init__(self, hidden: int, ffn: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k, self.n_experts = top_k, n_experts
        self.router = nn.Linear(hidden, n_experts, bias=False)
        self.experts = Experts(n_experts, hidden, ffn)

    def route(self, x: torch.Tensor):
        """(router probabilities [T, E], the top_k weights [T, k] normalized, their experts [T, k])."""
        probs = torch.softmax(self.router(x), dim=-1)
        weight, expert = probs.topk(self.top_k, dim=-1)
        return probs, weight / weight.sum(-1, keepdim=True), expert

    def forward(self, x: torch.Tensor, reduce: Reduce | None = None, total_tokens: int | None = None, dispatch=None, backend: str = "auto"):
        """x [T, hidden] -> ([T, hidden], aux_loss scalar). dispatch: the rank's expert-parallel
        group (None: every expert here); backend: the row gathers' (kernels.permute)."""
        probs, weight, expert = self.route(x)
        k = self.top_k
        flat = expert.reshape(-1)  # slot t * k + i: token t's i-th expert
        order = torch.argsort(flat, stable=True)
        inverse = inverse_permutation(order)
        counts = torch.bincount(flat, minlength=self.n_experts)
        if dispatch is None:
            y = self.experts(gather_slots(x, order, inverse, k, backend), counts.tolist())  # one host sync: the GEMMs' sizes
        else:
            y = dispatch(x, order, flat[order], k, self.experts)
        slots = permute_rows(y, inverse, order, backend)  # slot order again
        out = (slots.view(x.shape[0], k, x.shape[1]) * weight.unsqueeze(-1).to(slots.dtype)).sum(dim=1).to(x.dtype)
        counts = counts.to(x.dtype)
        mass = probs.sum(0)
        if reduce is not None:
            counts, mass = reduce(counts.detach()), reduce(mass)
        n = total_tokens if total_tokens is not None else x.shape[0]
        aux = probs.shape[-1] * ((counts / (n * self.top_k)) * (mass / n)).sum() if n else x.sum() * 0
        return out, aux
