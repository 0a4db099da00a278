"""Token-wise layers: RMSNorm, rotary embeddings with per-sample positions (Rotary), top-k MoE."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from .experts import Experts, gather_slots, inverse_permutation, permute_rows


class RMSNorm(nn.Module):
    """x / rms(x) x weight; zero_centered: x / rms(x) x (1 + weight), the weight starting at 0 (Qwen3-Next's)."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> [..., dim]"""
        scale = 1 + self.weight if self.zero_centered else self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * scale


class Rotary:
    """Rotary cos/sin of a step's token positions, gathered from a per-process table of every
    position so far (computed in float64 once, grown by doubling) and cast once per dtype: no
    trigonometry in the step, none in the layers."""

    _tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __init__(
        self,
        positions: torch.Tensor,
        head_dim: int,
        theta: float,
        ranges: list[tuple[int, int]] | None = None,
        scaling: dict | None = None,
        rotary_dim: int | None = None,
    ):
        """ranges: the positions as (start, stop) runs, when known (a rank's chunks of its samples):
        the step's tables are then copies of table slices rather than a gather. scaling: YaRN's
        parameters (ModelConfig.rope_scaling), or none. rotary_dim: the leading elements of a head
        that turn (the rest pass through: partial rotary); None: all of them."""
        self.positions, self.ranges, self.theta = positions, ranges, float(theta)
        self.scaling = tuple(sorted((scaling or {}).items()))
        turned = head_dim if rotary_dim is None else rotary_dim
        self.half, self.turned = turned // 2, turned
        if ranges is not None:
            self.n = max((b for _, b in ranges), default=1)
        else:
            self.n = int(positions.max()) + 1 if positions.numel() else 1
        self._step: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def _table(cls, n: int, head_dim: int, theta: float, device, dtype, scaling: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [>= n, head_dim / 2] of positions 0.. in `dtype` (computed in float64)."""
        key = (head_dim, theta, scaling, str(device), dtype)
        have = cls._tables.get(key)
        if have is None or have[0].shape[0] < n:
            size = max(1024, 1 << (n - 1).bit_length())
            half = head_dim // 2
            inv = 1.0 / (theta ** (torch.arange(0, half, device=device, dtype=torch.float64) / half))
            scale = 1.0
            if scaling:
                inv, scale = yarn(inv, head_dim, theta, dict(scaling))
            ang = torch.arange(size, device=device, dtype=torch.float64)[:, None] * inv[None, :]
            cls._tables[key] = have = ((ang.cos() * scale).to(dtype), (ang.sin() * scale).to(dtype))
        return have

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim / 2] of this step's positions in `dtype` (made on first use)."""
        if dtype not in self._step:
            cos, sin = self._table(self.n, self.turned, self.theta, self.positions.device, dtype, self.scaling)
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
        return torch.cat([rot, x[..., 2 * h :]], dim=-1) if 2 * h < x.shape[-1] else rot


def yarn(inv: torch.Tensor, head_dim: int, theta: float, p: dict) -> tuple[torch.Tensor, float]:
    """YaRN's rotary scaling (Peng et al., 2023): each frequency's inverse `inv` [head_dim / 2]
    blended between itself (the fast-turning dimensions, kept) and itself / factor (the slow ones,
    interpolated) by a linear ramp over the dimensions whose wavelengths fall between beta_fast and
    beta_slow turns in the original context (its ends floored and ceiled unless truncate is false),
    and the scale cos and sin take: 1 + 0.1 ln factor."""
    factor, original = p["factor"], p["original_max_position_embeddings"]

    def dim_of(turns: float) -> float:  # the dimension that turns `turns` times over the original context
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(p.get("beta_fast", 32)), dim_of(p.get("beta_slow", 1))
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width
    ramp = ((torch.arange(inv.numel(), dtype=torch.float64, device=inv.device) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: extrapolate (the frequency as it was); 0: interpolate
    blended = inv / factor * (1 - kept) + inv * kept
    return blended, (0.1 * math.log(factor) + 1.0) if factor > 1 else 1.0


Reduce = Callable[[torch.Tensor], torch.Tensor]


class SwiGLU(nn.Module):
    """A dense SwiGLU: (silu(x w1) x (x w3)) w2, in the experts' layout."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(hidden, ffn) / hidden**0.5)
        self.w3 = nn.Parameter(torch.randn(hidden, ffn) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(ffn, hidden) / ffn**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.silu(x @ self.w1) * (x @ self.w3)) @ self.w2


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with an optional load-balancing auxiliary loss.

    The auxiliary loss uses per-expert sums over the *global* batch (`reduce` all-reduces them in
    a distributed step), so it does not depend on how tokens are laid out over ranks, nor on the
    expert-parallel degree. A token's slots are sorted by expert (a stable sort: token order
    within an expert), run by the rank's own experts or, given a model.experts.ExpertDispatch, by
    the ranks of its expert-parallel group, and summed back weighted in slot order.
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        n_experts: int,
        top_k: int,
        router_bias: bool = False,
        softmax_topk: bool = False,
        shared_ffn: int = 0,
        shared_gate: bool = False,
        score: str = "softmax",
        score_bias: bool = False,
        groups: int = 1,
        topk_groups: int = 1,
        scaling: float = 1.0,
        **experts,
    ):
        """router_bias: the router's logits carry a bias; softmax_topk: a token's top-k experts
        are weighted by the softmax of their logits (gpt-oss's), not by the softmax's top-k
        renormalized (the same weights without a bias: the softmax is monotone). score "sigmoid"
        (Kimi Linear's, DeepSeek-V3's): each expert scored by the sigmoid of its logit, the top-k
        chosen by the scores plus a per-expert bias where score_bias (a buffer: set by a
        balancing rule or a checkpoint, not by the gradient) among the topk_groups of `groups`
        groups whose two best scores sum highest, and weighted by their unbiased scores
        renormalized. scaling multiplies the routed experts' weights. shared_ffn: a SwiGLU of this
        width every token runs beside its experts, scaled by a sigmoid gate of one output where
        shared_gate (Qwen3-Next's). experts: the Experts' bias, limit and alpha."""
        super().__init__()
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"router score {score!r}; valid: 'softmax', 'sigmoid'")
        self.top_k, self.n_experts, self.softmax_topk = top_k, n_experts, softmax_topk
        self.score, self.groups, self.topk_groups, self.scaling = score, groups, topk_groups, scaling
        self.router = nn.Linear(hidden, n_experts, bias=router_bias)
        self.register_buffer("score_bias", torch.zeros(n_experts) if score_bias else None)
        self.experts = Experts(n_experts, hidden, ffn, **experts)
        self.shared = SwiGLU(hidden, shared_ffn) if shared_ffn else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if shared_gate else None

    def route(self, x: torch.Tensor):
        """(router probabilities [T, E] (a sigmoid router's scores normalized per token: the
        auxiliary loss's), the top_k weights [T, k], their experts [T, k])."""
        logits = self.router(x)
        if self.score == "sigmoid":
            scores = torch.sigmoid(logits)
            choice = scores if self.score_bias is None else scores + self.score_bias.to(scores.dtype)
            if self.groups > 1:  # only the experts of the groups whose two best scores sum highest
                per = self.n_experts // self.groups
                best = choice.view(-1, self.groups, per).topk(2, dim=-1).values.sum(-1)
                chosen = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_groups, dim=-1).indices, True)
                choice = choice.masked_fill(~chosen.repeat_interleave(per, dim=1), float("-inf"))
            expert = choice.topk(self.top_k, dim=-1).indices
            weight = scores.gather(1, expert)
            probs, weight = scores / scores.sum(-1, keepdim=True), weight / (weight.sum(-1, keepdim=True) + 1e-20)
        elif self.softmax_topk:
            probs = torch.softmax(logits, dim=-1)
            top, expert = logits.topk(self.top_k, dim=-1)
            weight = torch.softmax(top, dim=-1)
        else:
            probs = torch.softmax(logits, dim=-1)
            weight, expert = probs.topk(self.top_k, dim=-1)
            weight = weight / weight.sum(-1, keepdim=True)
        return probs, weight * self.scaling, expert

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
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared)
        counts = counts.to(x.dtype)
        mass = probs.sum(0)
        if reduce is not None:
            counts, mass = reduce(counts.detach()), reduce(mass)
        n = total_tokens if total_tokens is not None else x.shape[0]
        aux = probs.shape[-1] * ((counts / (n * self.top_k)) * (mass / n)).sum() if n else x.sum() * 0
        return out, aux
