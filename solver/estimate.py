"""Closed-form step-time estimate of a plan, used by the solvers (the simulator is the detailed
per-rank timeline; both use the same CostModel terms).

A parent's time is: full attention over its ranks + the latency of its full-layer exchanges +
the slowest rank's share of everything that scales with the tokens a rank holds in the token
layout (token-wise and sparse work, and the per-token cost of the full-layer exchanges, whose
duration follows the rank that sends the most: a child rank holding more tokens than the
parent's average slows the parent's entry and exit).
"""

from __future__ import annotations

import numpy as np

from .children import solve_sorted
from .cluster import Cluster
from .cost import CostModel
from .layout import Group


def full_part(group: Group, lengths: np.ndarray, cost: CostModel) -> float:
    """Full attention in the parent head layout plus the fixed cost of its exchanges."""
    return float(cost.full_cost(lengths).sum() / group.size + cost.model.n_full * cost.exchange_line(group.size)[1])


def own_layout_part(group: Group, lengths: np.ndarray, cost: CostModel) -> float:
    """Per-token work when every layer keeps the group's own (evenly split) layout."""
    p = group.size
    per_rank = lengths.sum() / p
    a, b = cost.exchange_line(p)
    return float(cost.linear_cost(lengths).sum() / p + cost.model.n_sparse * (a * per_rank + b) + cost.model.n_full * a * per_rank)


def group_time(group: Group, lengths: np.ndarray, cluster: Cluster, cost: CostModel, repack: bool, quick: bool = False) -> float:
    """Estimated training seconds of one parent group (its slowest rank)."""
    if len(lengths) == 0:
        return 0.0
    t = full_part(group, lengths, cost)
    own = own_layout_part(group, lengths, cost)
    if repack and group.size > cluster.gpus_per_node and lengths.max() <= cluster.gpus_per_node * cluster.tokens_per_rank:
        sol = solve_sorted(tuple(sorted((int(n) for n in lengths), reverse=True)), group.size, cluster, cost, quick)
        if sol is not None:
            return t + min(own, sol.makespan)  # solve_children keeps the parent layout when it is faster
    return t + own


def step_time(groups, length_of: dict[int, int], cluster: Cluster, cost: CostModel, repack: bool, quick: bool = False) -> float:
    """The step estimate: the slowest parent group."""
    return max(group_time(g, np.array([length_of[s] for s in g.samples], dtype=np.int64), cluster, cost, repack, quick) for g in groups)
