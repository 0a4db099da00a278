"""One training step of a StepPlan on a process group.

Token-wise work runs on each rank's tokens of the child layout (the parent layout when not
repacked). Full attention: entry exchange (child token layout -> parent head layout), varlen
attention over the parent's samples, exit exchange (parent head layout -> child token layout).
Sparse attention: the child's own node-local exchange pair, or local attention for a child of
one rank. Baseline is the same code with child layout == parent layout. Parameters are
replicated; gradients are summed over the world after backward.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from kernels.exchange import AlignedGroups, CommStats, dist_transport, exchange, exchange_args
from solver import StepPlan, head_cu_seqlens, token_ids, token_to_head_rank
from solver.config import ModelConfig

from .attention import varlen_attention
from .hybrid import IGNORE, next_token_labels


class LayoutError(RuntimeError):
    """The plan cannot run on this process group; the message says why."""


def validate(plan: StepPlan, cfg: ModelConfig, world_size: int, rank: int, check_hash: bool = True) -> None:
    """Fail fast, before any exchange, with a message naming the problem (never a hang)."""
    if plan.cluster.world_size != world_size:
        raise LayoutError(f"the plan is for {plan.cluster.world_size} ranks but the process group has {world_size}")
    sizes = sorted({g.size for g in plan.parent_layout.groups} | {g.size for g in plan.child_layout.groups})
    for p in sizes:
        if cfg.n_heads % p:
            raise LayoutError(
                f"n_heads={cfg.n_heads} is not divisible by group size {p} used by this plan (group sizes {sizes}): "
                f"query heads must split evenly over every group"
            )
        if cfg.n_kv_heads % p and p % cfg.n_kv_heads:
            raise LayoutError(
                f"n_kv_heads={cfg.n_kv_heads} neither divides nor is divided by group size {p} used by this plan (group "
                f"sizes {sizes}): key/value heads split evenly or are replicated over p / n_kv_heads ranks each"
            )
    if check_hash and dist.is_initialized():
        hashes = [None] * world_size
        dist.all_gather_object(hashes, plan.hash)
        bad = [r for r, h in enumerate(hashes) if h != hashes[0]]
        if bad:
            raise LayoutError(
                f"plan hash differs across ranks: rank {bad[0]} has {hashes[bad[0]]}, rank 0 has {hashes[0]} "
                f"(plans must be computed identically on every rank)"
            )


def rank_exchanges(plan: StepPlan, cfg: ModelConfig, rank: int, device="cpu"):
    """(full entry, full exit, sparse entry, sparse exit) of `rank`, as device tensors: only this
    rank's part of each exchange, so the host work of a step grows with the rank's groups, not
    with the cluster (experiments.host_bench times it). An exit is its entry's inverse."""
    parent, child = plan.parent_layout, plan.child_layout
    qkv = [cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads]
    full = token_to_head_rank(child, parent, rank)
    sparse = token_to_head_rank(child, child, rank)
    return (
        exchange_args(full, qkv, device),
        exchange_args(full.inverse(), qkv[:1], device),
        exchange_args(sparse, qkv, device),
        exchange_args(sparse.inverse(), qkv[:1], device),
    )


class DistributedContext:
    """Attention for one rank of one step, with the step's exchanges precomputed."""

    def __init__(
        self,
        plan: StepPlan,
        cfg: ModelConfig,
        rank: int,
        groups: AlignedGroups,
        path: str = "auto",
        backend: str = "auto",
        stats: CommStats | None = None,
        device="cpu",
    ):
        self.cfg, self.rank, self.path, self.backend, self.stats = cfg, rank, path, backend, stats
        self.transport = dist_transport(groups)
        parent, child = plan.parent_layout, plan.child_layout
        self.parent_group = parent.group_of_rank()[rank]
        self.child_group = child.group_of_rank()[rank]
        self.full_entry, self.full_exit, self.sparse_entry, self.sparse_exit = rank_exchanges(plan, cfg, rank, device)
        full_cu = head_cu_seqlens(parent, self.parent_group)
        sparse_cu = head_cu_seqlens(child, self.child_group)
        # the longest sample of each head layout, from the host copy: no device sync per layer
        self.full_max, self.sparse_max = _max_len(full_cu), _max_len(sparse_cu)
        self.full_cu = torch.as_tensor(full_cu, device=device)
        self.sparse_cu = torch.as_tensor(sparse_cu, device=device)
        self.ids = token_ids(child, rank)  # sample_id << 32 | position, in local order
        self.positions = torch.as_tensor(self.ids & 0xFFFFFFFF, device=device)
        self.reduce = lambda t: dist_fn.all_reduce(t)
        self.total_tokens = int(sum(n for _, n in plan.lengths))

    def _heads(self, y: torch.Tensor, p: int):
        h, hkv = self.cfg.n_heads // p, max(self.cfg.n_kv_heads // p, 1)  # one replicated KV head when p > n_kv_heads
        return y[:, :h], y[:, h : h + hkv], y[:, h + hkv :]

    def attend(self, qkv, kind, layer):
        if kind == "F":
            entry, exit_, cu, max_len, p, site = (
                self.full_entry,
                self.full_exit,
                self.full_cu,
                self.full_max,
                self.parent_group.size,
                "full",
            )
            attn_kind, params = "full", None
        else:
            entry, exit_, cu, max_len, p = self.sparse_entry, self.sparse_exit, self.sparse_cu, self.sparse_max, self.child_group.size
            site, attn_kind, params = "sparse", self.cfg.sparse_kind, self.cfg.sparse_params
        if p == 1:  # a group of one rank holds whole samples in head order: no communication
            q, k, v = self._heads(qkv, 1)
            return varlen_attention(q, k, v, cu, max_len, attn_kind, params, self.backend)
        y = exchange(qkv, entry, self.transport, self.path, self.stats, f"{site}.entry")
        q, k, v = self._heads(y, p)
        o = varlen_attention(q, k, v, cu, max_len, attn_kind, params, self.backend)
        return exchange(o.contiguous(), exit_, self.transport, self.path, self.stats, f"{site}.exit")

    def local_batch(self, sample_tokens: dict[int, np.ndarray], device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's input tokens and next-token labels, from every sample's token ids."""
        ids = sorted(sample_tokens)
        labels = dict(zip(ids, next_token_labels([sample_tokens[s] for s in ids])))
        sample = (self.ids >> 32).astype(np.int64)
        pos = (self.ids & 0xFFFFFFFF).astype(np.int64)
        toks = np.array([sample_tokens[s][p] for s, p in zip(sample, pos)], dtype=np.int64)
        labs = np.array([labels[s][p] for s, p in zip(sample, pos)], dtype=np.int64)
        return torch.as_tensor(toks, device=device), torch.as_tensor(labs, device=device)


def _max_len(cu: np.ndarray) -> int:
    return int(np.diff(cu).max()) if len(cu) > 1 else 0


def label_count(plan: StepPlan) -> int:
    """Labelled tokens of the global batch: every token but each sample's last."""
    return sum(n - 1 for _, n in plan.lengths)


def allreduce_grads(model: torch.nn.Module) -> None:
    """Sum every parameter's gradient over the world (parameters are replicated)."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)


def run_step(
    model,
    plan: StepPlan,
    sample_tokens: dict[int, np.ndarray],
    groups: AlignedGroups,
    path="auto",
    backend="auto",
    stats: CommStats | None = None,
    check_hash: bool = True,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Forward + backward of one step on this rank; returns the global loss (summed over ranks).
    Gradients are all-reduced in place. autocast_dtype (bf16 on CUDA) wraps the forward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    validate(plan, model.cfg, world, rank, check_hash)
    dev = next(model.parameters()).device
    ctx = DistributedContext(plan, model.cfg, rank, groups, path, backend, stats, dev)
    tokens, labels = ctx.local_batch(sample_tokens, dev)
    if autocast_dtype is not None:
        with torch.autocast(dev.type, dtype=autocast_dtype):
            loss = model.loss(tokens, labels, ctx, label_count(plan), world)
    else:
        loss = model.loss(tokens, labels, ctx, label_count(plan), world)
    loss.backward()
    allreduce_grads(model)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total


__all__ = ["DistributedContext", "LayoutError", "allreduce_grads", "label_count", "run_step", "validate", "IGNORE"]
