"""Closed-form step-time estimate of a plan, used by the parent solver (the simulator in
experiments/ is the detailed per-rank timeline; both use the same CostModel terms)."""

from __future__ import annotations

import numpy as np

from .children import child_problem, solve_child_problem
from .cluster import Cluster
from .cost import CostModel
from .layout import Group


def full_part(group: Group, lengths: np.ndarray, cost: CostModel) -> float:
    """Full attention in the parent head layout plus the parent's entry/exit exchanges."""
    p = group.size
    per_rank = lengths.sum() / p
    return float(cost.full_cost(lengths).sum() / p + cost.model.n_full * cost.layer_exchange_time(per_rank, group.start, p, group.start))


def own_layout_part(group: Group, lengths: np.ndarray, cost: CostModel) -> float:
    """Token-wise and sparse work when the sparse layers keep the group's own layout."""
    p = group.size
    per_rank = lengths.sum() / p
    return float(
        cost.linear_cost(lengths).sum() / p + cost.model.n_sparse * cost.layer_exchange_time(per_rank, group.start, p, group.start)
    )


def group_time(group: Group, lengths: np.ndarray, cluster: Cluster, cost: CostModel, repack: bool, quick: bool = False) -> float:
    """Estimated training seconds of one parent group (its slowest rank)."""
    if len(lengths) == 0:
        return 0.0
    t = full_part(group, lengths, cost)
    own = own_layout_part(group, lengths, cost)
    if repack and group.size > cluster.gpus_per_node and lengths.max() <= cluster.gpus_per_node * cluster.tokens_per_rank:
        sol = solve_child_problem(child_problem(lengths, group.size, cluster, cost), quick=quick)
        if sol is not None:
            return t + min(own, sol.makespan)  # solve_children keeps the parent layout when it is faster
    return t + own


def step_time(groups, length_of: dict[int, int], cluster: Cluster, cost: CostModel, repack: bool) -> float:
    return max(group_time(g, np.array([length_of[s] for s in g.samples], dtype=np.int64), cluster, cost, repack) for g in groups)
