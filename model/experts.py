"""A MoE layer's experts, and their expert-parallel dispatch and combine.

`Experts` holds the SwiGLU weights of the experts a rank holds: all of them, or, under expert
parallelism of degree N, the n_experts / N of its slot in its EP group (model.HybridMoE.
expert_parallel slices them). It runs rows already grouped by expert: one grouped GEMM per
projection where torch has one on the device (torch._grouped_mm on CUDA, bf16), a loop over the
experts otherwise (the reference).

`ExpertDispatch` is one rank's part of an EP group of N aligned ranks. After routing, the rank's
token-slots (each token top_k times) are sorted by expert, which sorts them by destination (expert
e lives on the group's rank e // (n_experts / N)); then

1. one fused row gather packs every slot's hidden state in that order (the project's Triton
   permute on CUDA, the torch reference elsewhere: kernels.permute);
2. one small all-to-all sends each destination the slot counts per expert it will get;
3. one all-to-all with uneven splits carries the slots; the received blocks (one per source,
   each sorted by expert) are gathered into expert order;
4. the experts run; their rows go back to block order and through the reverse all-to-all;
5. each slot's output returns to the slot's position (one gather) and a token's top_k outputs
   are summed weighted in slot order: a fixed order, no atomics.

Every step is differentiable: the gathers' backward are gathers (a replicated token's gradients
summed over its top_k slots in slot order), an all-to-all's backward is the reverse all-to-all.
The host waits once per layer for the received counts (all_to_all_single takes its split sizes
as lists, and so does the CPU loop); the grouped GEMM takes the per-expert offsets on the device.
The layer's tokens are those of the token layout it runs in (a parent, a child), so the traffic
per rank follows the layout, as on a cluster.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels.exchange import all_to_all_rows
from kernels.permute import gather_rows
from solver.sites import Site


class _Permute(torch.autograd.Function):
    """out = x[rows] for a permutation `rows`; backward: grad[inverse]."""

    @staticmethod
    def forward(ctx, x, rows, inverse, backend):
        ctx.inverse, ctx.backend = inverse, backend
        return gather_rows(x, rows, backend)

    @staticmethod
    def backward(ctx, grad):
        return gather_rows(grad.contiguous(), ctx.inverse, ctx.backend), None, None, None


class _GatherSlots(torch.autograd.Function):
    """out[m] = x[order[m] // k]: every token's k slots, in `order`; backward: the slots' gradients
    back in slot order (a gather by the inverse order) and each token's k summed in slot order."""

    @staticmethod
    def forward(ctx, x, order, inverse, k, backend):
        ctx.inverse, ctx.k, ctx.backend = inverse, k, backend
        return gather_rows(x, torch.div(order, k, rounding_mode="floor"), backend)

    @staticmethod
    def backward(ctx, grad):
        slots = gather_rows(grad.contiguous(), ctx.inverse, ctx.backend)
        return slots.view(-1, ctx.k, slots.shape[1]).sum(dim=1), None, None, None, None


def permute_rows(x, rows, inverse, backend: str = "auto"):
    """x [n, h] -> x[rows], differentiable; `inverse` is rows' inverse permutation.

    >>> x = torch.arange(6.).view(3, 2)
    >>> permute_rows(x, torch.tensor([2, 0, 1]), torch.tensor([1, 2, 0]), "torch").tolist()
    [[4.0, 5.0], [0.0, 1.0], [2.0, 3.0]]
    """
    return _Permute.apply(x, rows, inverse, backend)


def gather_slots(x, order, inverse, k: int, backend: str = "auto"):
    """x [T, h] -> [T k, h]: token order[m] // k at row m (each token's k routing slots)."""
    return _GatherSlots.apply(x, order, inverse, k, backend)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return inv


class Experts(nn.Module):
    """The SwiGLU experts a rank holds: w1, w3 [E, hidden, ffn], w2 [E, ffn, hidden], experts
    first..first+E-1 of the layer. bias: b1, b3 [E, ffn] and b2 [E, hidden] too; limit: gpt-oss's
    clamped SwiGLU (clamped_swiglu) in place of silu(x w1) x (x w3)."""

    def __init__(self, n_experts: int, hidden: int, ffn: int, bias: bool = False, limit: float | None = None, alpha: float = 1.702):
        super().__init__()
        self.first, self.bias, self.limit, self.alpha = 0, bias, limit, alpha
        self.w1 = nn.Parameter(torch.randn(n_experts, hidden, ffn) / hidden**0.5)
        self.w3 = nn.Parameter(torch.randn(n_experts, hidden, ffn) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, ffn, hidden) / ffn**0.5)
        self.names = ("w1", "w3", "w2")
        if bias:
            self.b1, self.b3 = nn.Parameter(torch.zeros(n_experts, ffn)), nn.Parameter(torch.zeros(n_experts, ffn))
            self.b2 = nn.Parameter(torch.zeros(n_experts, hidden))
            self.names += ("b1", "b3", "b2")

    @property
    def count(self) -> int:
        return self.w1.shape[0]

    def keep(self, first: int, count: int) -> None:
        """Hold only experts first..first+count-1 (the slice of an expert-parallel rank)."""
        with torch.no_grad():
            for name in self.names:
                setattr(self, name, nn.Parameter(getattr(self, name)[first : first + count].clone()))
        self.first = first

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [R, hidden] grouped by expert (counts[e] rows of expert e, in order) -> [R, hidden]."""
        if self.grouped(rows) and not self.bias and self.limit is None:  # the grouped GEMMs run the plain SwiGLU
            offs = torch.cumsum(torch.as_tensor(counts, device=rows.device, dtype=torch.int32), 0, dtype=torch.int32)
            h = F.silu(torch._grouped_mm(rows, self.w1, offs=offs)) * torch._grouped_mm(rows, self.w3, offs=offs)
            return torch._grouped_mm(h, self.w2, offs=offs)
        return self.reference(rows, counts)

    def grouped(self, rows: torch.Tensor) -> bool:
        """Does the grouped GEMM take these operands? torch._grouped_mm on CUDA: bf16, 16-byte
        aligned, sizes multiples of 8 (FSDP2's gathered weights are views: their alignment is checked)."""
        if rows.device.type != "cuda" or not hasattr(torch, "_grouped_mm") or rows.dtype != torch.bfloat16:
            return False
        ops = (rows, self.w1, self.w3, self.w2)
        return (
            all(t.dtype == torch.bfloat16 and t.data_ptr() % 16 == 0 for t in ops) and rows.shape[1] % 8 == 0 and self.w1.shape[2] % 8 == 0
        )

    def reference(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The loop over experts forward runs on CPU (and the yardstick of the grouped GEMM)."""
        ys, at = [], 0
        for e, c in enumerate(counts):
            if c:
                ys.append(self.expert(rows[at : at + c], e))
            at += c
        if not ys:  # no row here: an empty product keeps the experts in the graph (zero gradients),
            ys.append(self.expert(rows[:0], 0))  # so every rank reduces the same parameters (FSDP2 reduce-scatters those with a gradient)
        return torch.cat(ys)

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e (of those held) on rows x [R, hidden]."""
        gate, up = x @ self.w1[e], x @ self.w3[e]
        if self.bias:
            gate, up = gate + self.b1[e], up + self.b3[e]
        h = F.silu(gate) * up if self.limit is None else clamped_swiglu(gate, up, self.limit, self.alpha)
        y = h @ self.w2[e]
        return y + self.b2[e] if self.bias else y


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's SwiGLU: the gate clamped to at most `limit`, up to [-limit, limit], then
    (up + 1) x gate x sigmoid(alpha x gate)."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


class ExpertDispatch:
    """One rank's part of an expert-parallel group: [start, start + size) of the world, each rank
    holding n_experts / size experts. group: its process group (None: a group of one, no
    communication); stats: a kernels.exchange.CommStats that counts the all-to-alls under
    moe.dispatch and moe.combine (and .bwd)."""

    def __init__(self, start: int, size: int, rank: int, n_experts: int, group, backend: str = "auto", stats=None):
        if n_experts % size:
            raise ValueError(f"{n_experts} experts cannot be split over an expert-parallel group of {size} ranks")
        self.start, self.size, self.rank, self.n_experts = start, size, rank, n_experts
        self.local = n_experts // size
        self.group, self.backend, self.stats = group, backend, stats

    def __call__(self, x: torch.Tensor, order: torch.Tensor, sorted_experts: torch.Tensor, k: int, experts: Experts) -> torch.Tensor:
        """x [T, hidden], the slots' order by expert and their experts in that order -> each slot's
        output [T k, hidden] in that order."""
        n, local, dev = self.size, self.local, x.device
        inverse = inverse_permutation(order)
        send = gather_slots(x, order, inverse, k, self.backend)  # by destination, then expert
        per_expert = torch.bincount(sorted_experts, minlength=self.n_experts).reshape(n, local)
        got = all_to_all_rows(per_expert, [1] * n, [1] * n, self.group, self.stats, Site.EXPERTS_COUNTS)  # [sources, local experts]
        counts = got.tolist()  # the host's one wait per layer: the split sizes
        send_counts, recv_counts = per_expert.sum(1).tolist(), [sum(c) for c in counts]
        recv = all_to_all_rows(send, send_counts, recv_counts, self.group, self.stats, Site.EXPERTS_DISPATCH)
        # received: a block per source, each by local expert -> all rows by local expert
        c = np.asarray(counts, dtype=np.int64).reshape(n, local)
        block_start = np.concatenate([[0], np.cumsum(c.sum(1))])[:-1]
        within = np.cumsum(c, axis=1) - c  # start of expert e's rows inside source s's block
        by_expert = np.concatenate([np.arange(block_start[s] + within[s, e], block_start[s] + within[s, e] + c[s, e])
                                    for e in range(local) for s in range(n)] or [np.zeros(0, np.int64)])  # fmt: skip
        rows = torch.as_tensor(by_expert, dtype=torch.int64, device=dev)
        back = inverse_permutation(rows)
        y = experts(permute_rows(recv, rows, back, self.backend), c.sum(0).tolist())
        y = permute_rows(y, back, rows, self.backend)  # block order again
        return all_to_all_rows(y, recv_counts, send_counts, self.group, self.stats, Site.EXPERTS_COMBINE)


__all__ = ["ExpertDispatch", "Experts", "gather_slots", "inverse_permutation", "permute_rows"]
