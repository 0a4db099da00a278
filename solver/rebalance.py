"""Parent solver (repack+solver): move or swap samples between parents so children can balance.

Group shapes stay fixed; only membership changes. Trial moves are priced incrementally: a wide
parent keeps its current children, a sample leaving it leaves its child and a sample joining it
joins the child where it finishes earliest (an upper bound of what re-solving the children gives).
A move is taken only if the slowest group gets faster and the group receiving the sample stays
below the old slowest time, so the step estimate (the max over groups) never rises. After each
move the changed wide parents' children are re-solved and kept if better.
"""

from __future__ import annotations

import numpy as np

from .children import ChildProblem, child_problem, solve_child_problem
from .cluster import Cluster, ceil_div
from .cost import CostModel
from .estimate import exchange_line
from .layout import Group


class _GroupState:
    """Members of one parent and, for a repackable wide parent, its children (sample-id lists)."""

    def __init__(self, group: Group, ids: list[int], ctx: _Context):
        self.group, self.ctx = group, ctx
        self.wide = group.size > ctx.cluster.gpus_per_node
        self.set(ids)

    def lens(self, ids) -> np.ndarray:
        return np.array([self.ctx.length_of[s] for s in ids], dtype=np.int64)

    def set(self, ids: list[int], hint: list | None = None) -> None:
        """New members; children re-solved, or `hint` (the trial move's children) if better."""
        self.ids = list(ids)
        self.children: list[tuple[int, list[int]]] | None = None
        if self.wide and self.ids and self.lens(self.ids).max() <= self.ctx.node_cap:
            sol = solve_child_problem(child_problem(self.lens(self.ids), self.group.size, self.ctx.cluster, self.ctx.cost), quick=True)
            if sol is not None:
                self.children = [(c, [self.ids[i] for i in m]) for c, m in zip(sol.sizes, sol.members)]
        self.time = self.price(self.ids, self.children)
        if hint is not None and self.price(self.ids, hint) < self.time:
            self.children, self.time = hint, self.price(self.ids, hint)

    def child_time(self, size: int, ids) -> float:
        c = self.ctx
        return c.cp(self.group.size).child_time(size, sum(c.linear[s] for s in ids), sum(c.length_of[s] for s in ids))

    def price(self, ids, children) -> float:
        """estimate.group_time for these members, from cached per-sample terms (same formulas)."""
        if not ids:
            return 0.0
        c, p = self.ctx, self.group.size
        tok = sum(c.length_of[s] for s in ids)
        a, b = c.exchange_line(p)
        t = sum(c.full[s] for s in ids) / p + c.cost.model.n_full * b
        own = sum(c.linear[s] for s in ids) / p + c.cost.model.n_sparse * (a * tok / p + b) + c.cost.model.n_full * a * tok / p
        if children is not None:
            return t + min(own, max(self.child_time(k, m) for k, m in children))
        return t + own

    def without(self, a: int) -> tuple[list[int], list | None]:
        ids = [s for s in self.ids if s != a]
        kids = None if self.children is None else [(c, [s for s in m if s != a]) for c, m in self.children]
        return ids, kids

    def with_(self, a: int, ids=None, kids=None) -> tuple[list[int], list | None] | None:
        """Add `a` (to `ids`/`kids` if given); None if it does not fit the token budget."""
        ids = self.ids if ids is None else ids
        kids = self.children if kids is None else kids
        budget, n = self.ctx.cluster.tokens_per_rank, self.ctx.length_of[a]
        if sum(ceil_div(self.ctx.length_of[s], self.group.size) for s in ids) + ceil_div(n, self.group.size) > budget:
            return None
        if kids is None or n > self.ctx.node_cap:
            return ids + [a], None
        best, best_t = -1, float("inf")
        for k, (c, m) in enumerate(kids):
            if sum(ceil_div(self.ctx.length_of[s], c) for s in m) + ceil_div(n, c) > budget:
                continue
            t = self.child_time(c, m + [a])
            if t < best_t:
                best, best_t = k, t
        if best < 0:
            return ids + [a], None
        new = [(c, m + [a]) if k == best else (c, m) for k, (c, m) in enumerate(kids)]
        return ids + [a], new


class _Context:
    def __init__(self, length_of, cluster: Cluster, cost: CostModel):
        self.length_of, self.cluster, self.cost = length_of, cluster, cost
        self.node_cap = cluster.gpus_per_node * cluster.tokens_per_rank
        ids = list(length_of)
        lin = cost.linear_cost(np.array([length_of[s] for s in ids], dtype=np.float64))
        self.linear = dict(zip(ids, map(float, lin)))
        self.full = dict(zip(ids, map(float, cost.full_cost(np.array([length_of[s] for s in ids], dtype=np.float64)))))
        self._lines: dict[int, tuple[float, float]] = {}
        self.scost = dict(zip(ids, map(float, cost.sample_cost(np.array([length_of[s] for s in ids], dtype=np.float64)))))
        self._cps: dict[int, ChildProblem] = {}

    def cp(self, parent_size: int) -> ChildProblem:
        if parent_size not in self._cps:
            self._cps[parent_size] = child_problem([], parent_size, self.cluster, self.cost)
        return self._cps[parent_size]

    def exchange_line(self, size: int) -> tuple[float, float]:
        """layer_exchange_time(x tokens per rank) = a * x + b for an aligned group of `size`."""
        if size not in self._lines:
            self._lines[size] = exchange_line(self.cost, size)
        return self._lines[size]


def rebalance_parents(
    groups: tuple[Group, ...],
    length_of: dict[int, int],
    cluster: Cluster,
    cost: CostModel,
    max_moves: int | None = None,
    n_samples: int = 10,
    n_targets: int = 6,
) -> tuple[Group, ...]:
    ctx = _Context(length_of, cluster, cost)
    states = [_GroupState(g, list(g.samples), ctx) for g in groups]
    max_moves = 2 * len(groups) + 32 if max_moves is None else max_moves
    for _ in range(max_moves):
        times = np.array([s.time for s in states])
        worst = int(np.argmax(times))
        cur = times[worst]
        src = states[worst]
        by_cost = sorted(src.ids, key=lambda s: -ctx.scost[s])
        # a spread of sizes: large samples move much load, small ones fine-tune
        picks = sorted(set(np.linspace(0, len(by_cost) - 1, min(n_samples, len(by_cost))).round().astype(int)))
        cands = [by_cost[i] for i in picks]
        targets = [int(k) for k in np.argsort(times) if k != worst][:n_targets]
        best = None
        for a in cands:
            ids_w, kids_w = src.without(a)
            t_worst = src.price(ids_w, kids_w)
            if t_worst >= cur:
                continue
            for k in targets:
                dst = states[k]
                moved = dst.with_(a)
                if moved is not None:
                    t = max(t_worst, dst.price(*moved))
                    if t < cur * (1 - 1e-9) and (best is None or t < best[0]):
                        best = (t, a, k, None, (ids_w, kids_w), moved)
                smaller = sorted((b for b in dst.ids if ctx.scost[b] < ctx.scost[a]), key=lambda b: -ctx.scost[b])[:2]
                for b in smaller:
                    ids_k, kids_k = dst.without(b)
                    into_k = dst.with_(a, ids_k, kids_k)
                    into_w = src.with_(b, ids_w, kids_w)
                    if into_k is None or into_w is None:
                        continue
                    t = max(src.price(*into_w), dst.price(*into_k))
                    if t < cur * (1 - 1e-9) and (best is None or t < best[0]):
                        best = (t, a, k, b, into_w, into_k)
        if best is None:
            break
        _, a, k, b, into_w, into_k = best
        src.set(*into_w)
        states[k].set(*into_k)
    return tuple(Group(s.group.start, s.group.size, tuple(s.ids)) for s in states)
