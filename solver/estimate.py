"""Closed-form step-time estimate of a plan, used by the solvers (the simulator is the detailed
per-rank timeline; both use the same CostModel terms).

A parent's time is CostModel.shared_time (full attention over its ranks and the fixed cost of its
full-layer exchanges) plus the slowest of its children's cost.rank_time: everything that scales
with the tokens a rank holds in the token layout (token-wise and sparse work, and the per-token
cost of the full-layer exchanges, whose duration follows the rank that sends the most: a child
rank holding more tokens than the parent's average slows the parent's entry and exit).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

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
        # ids -> rows as an array lookup where the ids are not much sparser than the samples
        # (every planner's step: ids 0..n-1), else through the dict (rows_of)
        self._ids = id_arr = np.fromiter(ids, dtype=np.int64, count=len(ids))  # row -> id
        self._pos = None
        if len(ids) and 0 <= int(id_arr.min()) and int(id_arr.max()) < 4 * len(ids) + 1024:
            self._pos = np.full(int(id_arr.max()) + 1, -1, dtype=np.int64)
            self._pos[id_arr] = np.arange(len(ids))
        self._len = lens
        self._lin = np.asarray(cost.linear_cost(lens), dtype=np.float64)
        self._full = np.asarray(cost.full_cost(lens), dtype=np.float64)
        self.linear = dict(zip(ids, self._lin.tolist()))
        self.full = dict(zip(ids, self._full.tolist()))

    def rows_of(self, ids: Iterable[int], count: int = -1) -> np.ndarray:
        """The rows of sample ids (in the per-sample arrays), in order; KeyError naming an id not in the step."""
        flat = np.fromiter(ids, dtype=np.int64, count=count)
        if self._pos is None:
            return np.fromiter(map(self._row.__getitem__, flat.tolist()), dtype=np.int64, count=len(flat))
        inside = (flat >= 0) & (flat < len(self._pos))
        rows = self._pos[np.where(inside, flat, 0)]
        bad = ~inside | (rows < 0)
        if bad.any():
            raise KeyError(f"sample id {int(flat[np.argmax(bad)])} is not in this step")
        return rows

    @staticmethod
    def _refuse_halo(parents) -> None:
        """It prices Ulysses children only: a parent with halo children (their exchanges are point
        to point, priced by CostModel.halo_line) is solver.reference.parent_time's, never a Ulysses guess."""
        halo = next((p for p in parents if p.halo), None)
        if halo is not None:
            raise ValueError(
                f"PlanEstimate prices Ulysses children, and the parent at rank {halo.group.start} has halo children: price it "
                f"with solver.reference.parent_time"
            )

    def parent_time(self, parent) -> float:
        """Seconds of one ParentPlan: full attention and exchanges over the parent, then its
        slowest child (an unrepacked parent's only child is the parent itself). Ulysses children
        only (a halo child: ValueError)."""
        self._refuse_halo((parent,))
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
        if not parents:
            return np.zeros(0)
        self._refuse_halo(parents)
        kids = [(j, c) for j, pp in enumerate(parents) for c in pp.children]
        nk = len(kids)
        counts = np.fromiter((len(c.samples) for _, c in kids), dtype=np.int64, count=nk)
        rows = self.rows_of(chain.from_iterable(c.samples for _, c in kids), int(counts.sum()))
        of = np.repeat(np.arange(nk), counts)
        parent_size = [pp.group.size for pp in parents]
        line, fixed_of = self.cost.child_line, self.cost.parent_fixed
        lin = np.bincount(of, self._lin[rows], nk)
        tok = np.bincount(of, self._len[rows], nk)
        full = np.bincount(of, self._full[rows], nk)
        sizes = np.fromiter((c.size for _, c in kids), dtype=np.int64, count=nk)
        owner = np.fromiter((j for j, _ in kids), dtype=np.int64, count=nk)
        psize = np.array(parent_size)
        lines = np.array([line(c.size, parent_size[j]) for j, c in kids]).reshape(nk, 2)
        kid_time = (lin + lines[:, 0] * tok) / sizes + lines[:, 1]  # cost.rank_time
        slowest = np.full(len(parents), -np.inf)
        np.maximum.at(slowest, owner, kid_time)
        pfull = np.bincount(owner, full, len(parents))
        fixed = np.array([fixed_of(p) for p in parent_size])
        times = pfull / psize + fixed + slowest  # cost.shared_time + the slowest child
        empty = np.array([not pp.group.samples for pp in parents])
        times[empty] = 0.0
        return times

    def plan_time(self, parents) -> float:
        return float(self.parent_times(parents).max())
