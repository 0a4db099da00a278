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
        # per-sample terms as arrays (parent_times) and by id (parent_time)
        self._row = {s: k for k, s in enumerate(ids)}
        self._len = lens
        self._lin = np.asarray(cost.linear_cost(lens), dtype=np.float64)
        self._full = np.asarray(cost.full_cost(lens), dtype=np.float64)
        self.linear = dict(zip(ids, self._lin.tolist()))
        self.full = dict(zip(ids, self._full.tolist()))

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

    def parent_times(self, parents) -> np.ndarray:
        """parent_time of every ParentPlan at once (the same arithmetic, summed with numpy)."""
        parents = list(parents)
        kid_rows, kid_of, kid_size, kid_parent = [], [], [], []
        for j, pp in enumerate(parents):
            for c in pp.children:
                k = len(kid_size)
                kid_size.append(c.size)
                kid_parent.append(j)
                kid_rows += [self._row[s] for s in c.samples]
                kid_of += [k] * len(c.samples)
        if not parents:
            return np.zeros(0)
        rows, of = np.array(kid_rows, dtype=np.int64), np.array(kid_of, dtype=np.int64)
        nk = len(kid_size)
        lin = np.bincount(of, self._lin[rows], nk)
        tok = np.bincount(of, self._len[rows], nk)
        full = np.bincount(of, self._full[rows], nk)
        sizes, owner = np.array(kid_size), np.array(kid_parent)
        psize = np.array([pp.group.size for pp in parents])
        lines = np.array([self.cost.child_line(int(c), int(psize[j])) for c, j in zip(sizes, owner)]).reshape(nk, 2)
        kid_time = (lin + lines[:, 0] * tok) / sizes + lines[:, 1]  # cost.rank_time
        slowest = np.full(len(parents), -np.inf)
        np.maximum.at(slowest, owner, kid_time)
        pfull = np.bincount(owner, full, len(parents))
        fixed = np.array([self.cost.parent_fixed(int(p)) for p in psize])
        times = pfull / psize + fixed + slowest  # cost.shared_time + the slowest child
        empty = np.array([not pp.group.samples for pp in parents])
        times[empty] = 0.0
        return times

    def plan_time(self, parents) -> float:
        return float(self.parent_times(parents).max())
