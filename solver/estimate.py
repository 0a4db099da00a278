"""Closed-form step-time estimate of a plan, used by the solvers (the simulator is the detailed
per-rank timeline; both use the same CostModel terms).

A parent's time is CostModel.shared_time (full attention over its ranks and the fixed cost of its
full-layer exchanges) plus the slowest of its children's cost.rank_time: everything that scales
with the tokens a rank holds in the token layout (token-wise and sparse work, and the per-token
cost of the full-layer exchanges, whose duration follows the rank that sends the most: a child
rank holding more tokens than the parent's average slows the parent's entry and exit).
"""

from __future__ import annotations

import numpy as np

from .cluster import Cluster
from .cost import CostModel, rank_time


class PlanEstimate:
    """Times of parents whose children are already chosen (ParentPlans), from per-sample terms
    computed once: the planner compares whole candidate plans with it."""

    def __init__(self, length_of: dict[int, int], cluster: Cluster, cost: CostModel):
        cost = cost.for_cluster(cluster)
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
            lin = sum(self.linear[s] for s in c.samples)
            tok = sum(self.length_of[s] for s in c.samples)
            slowest = max(slowest, rank_time(lin, tok, c.size, self.cost.child_line(c.size, g.size)))
        return self.cost.shared_time(sum(self.full[s] for s in g.samples), g.size) + slowest

    def plan_time(self, parents) -> float:
        return max(self.parent_time(pp) for pp in parents)
