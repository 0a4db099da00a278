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
    return float(cost.full_cost(lengths).sum() / group.size + cost.parent_fixed(group.size))


def own_layout_part(group: Group, lengths: np.ndarray, cost: CostModel) -> float:
    """Per-token work when every layer keeps the group's own (evenly split) layout."""
    a, b = cost.child_line(group.size, group.size)
    return float((cost.linear_cost(lengths).sum() + a * lengths.sum()) / group.size + b)


def group_time(group: Group, lengths: np.ndarray, cluster: Cluster, cost: CostModel, repack: bool) -> float:
    """Estimated training seconds of one parent group (its slowest rank)."""
    if len(lengths) == 0:
        return 0.0
    t = full_part(group, lengths, cost)
    own = own_layout_part(group, lengths, cost)
    if repack and group.size > cluster.gpus_per_node and lengths.max() <= cluster.gpus_per_node * cluster.tokens_per_rank:
        sol = solve_sorted(tuple(sorted((int(n) for n in lengths), reverse=True)), group.size, cluster, cost)
        if sol is not None:
            return t + min(own, sol.makespan)  # solve_children keeps the parent layout when it is faster
    return t + own


def step_time(groups, length_of: dict[int, int], cluster: Cluster, cost: CostModel, repack: bool) -> float:
    """The step estimate: the slowest parent group."""
    return max(group_time(g, np.array([length_of[s] for s in g.samples], dtype=np.int64), cluster, cost, repack) for g in groups)


class PlanEstimate:
    """group_time of parents whose children are already chosen (ParentPlans), from per-sample
    terms computed once: the planner compares whole candidate plans with it."""

    def __init__(self, length_of: dict[int, int], cluster: Cluster, cost: CostModel):
        self.length_of, self.cluster, self.cost = length_of, cluster, cost
        ids = list(length_of)
        lens = np.array([length_of[s] for s in ids], dtype=np.float64)
        self.linear = dict(zip(ids, cost.linear_cost(lens).tolist()))
        self.full = dict(zip(ids, cost.full_cost(lens).tolist()))

    def parent_time(self, parent) -> float:
        """Seconds of one ParentPlan: full attention and exchanges over the parent, then its
        slowest child (an unrepacked parent's only child is the parent itself)."""
        g = parent.group
        if not g.samples:
            return 0.0
        slowest = 0.0
        for c in parent.children:
            a, b = self.cost.child_line(c.size, g.size)
            lin = sum(self.linear[s] for s in c.samples)
            tok = sum(self.length_of[s] for s in c.samples)
            slowest = max(slowest, (lin + a * tok) / c.size + b)
        return sum(self.full[s] for s in g.samples) / g.size + self.cost.parent_fixed(g.size) + slowest

    def plan_time(self, parents) -> float:
        return max(self.parent_time(pp) for pp in parents)
