"""Parent solver, second stage: move or swap samples between parents so children can balance.

The planner starts it from the joint fill (parents.assign_with_children), whose children come
along; `rebalance_parents` starts it from bare parents and solves their children first.
Group shapes stay fixed; only membership changes. Trial moves are priced incrementally: a wide
parent keeps its current children, a sample leaving it leaves its child and a sample joining it
joins the child where it finishes earliest (an upper bound of what re-solving the children gives).
A move is taken only if the slowest group gets faster and the group receiving the sample stays
below the old slowest time, so the step estimate (the max over groups) never rises.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .children import ChildProblem, child_problem, solve_sorted
from .cluster import Cluster, ceil_div
from .cost import CostModel
from .layout import Group
from .parents import Kids


class _Kid:
    """A child: size, members and the sums its time needs (tokens, linear seconds, rank tokens)."""

    __slots__ = ("size", "members", "lin", "tok", "rtok")

    def __init__(self, size, members, lin, tok, rtok):
        self.size, self.members, self.lin, self.tok, self.rtok = size, members, lin, tok, rtok


class _Config:
    """Members of a parent with their sums, and its children (None: the parent's own layout)."""

    __slots__ = ("ids", "tok", "lin", "full", "rtok", "kids")

    def __init__(self, ids, tok, lin, full, rtok, kids):
        self.ids, self.tok, self.lin, self.full, self.rtok, self.kids = ids, tok, lin, full, rtok, kids


class _GroupState:
    """One parent: its current configuration and estimated time, with O(children) trial moves."""

    def __init__(self, group: Group, ids: list[int], ctx: _Context, kids: Kids | None = None):
        self.group, self.ctx = group, ctx
        self.p = group.size
        self.wide = group.size > ctx.cluster.gpus_per_node
        self.cp = ctx.cp(group.size)
        self.own_line = ctx.cost.child_line(group.size, group.size)
        self.fixed = ctx.cost.parent_fixed(group.size)
        if kids is not None and self.wide:  # a start that comes with its children (the joint fill)
            self.config = self._config(ids, kids)
            self.time = self.price(self.config)
        else:
            self.set(ids)

    def _config(self, ids, kids_members) -> _Config:
        c, p = self.ctx, self.p
        kids = None
        if kids_members is not None:
            kids = [
                _Kid(
                    size,
                    list(m),
                    sum(c.linear[s] for s in m),
                    sum(c.length_of[s] for s in m),
                    sum(ceil_div(c.length_of[s], size) for s in m),
                )
                for size, m in kids_members
            ]
        return _Config(
            list(ids),
            sum(c.length_of[s] for s in ids),
            sum(c.linear[s] for s in ids),
            sum(c.full[s] for s in ids),
            sum(ceil_div(c.length_of[s], p) for s in ids),
            kids,
        )

    def set(self, ids: list[int], hint: _Config | None = None) -> None:
        """New members. A trial move's configuration (`hint`) is taken as it is: its children are
        a valid assignment and its price an upper bound; the planner polishes the children it
        returns (children.polish_children). Without a hint the children are solved (quick)."""
        if hint is not None:
            self.config, self.time = hint, self.price(hint)
            return
        kids = None
        ids = sorted(ids, key=lambda s: (-self.ctx.length_of[s], s))
        lens = tuple(self.ctx.length_of[s] for s in ids)
        if self.wide and ids and lens[0] <= self.ctx.node_cap:
            sol = solve_sorted(lens, self.p, self.ctx.cluster, self.ctx.cost, True)
            if sol is not None:
                kids = [(c, [ids[i] for i in m]) for c, m in zip(sol.sizes, sol.members)]
        self.config = self._config(ids, kids)
        self.time = self.price(self.config)

    def price(self, cf: _Config) -> float:
        """estimate.group_time for this configuration (same formulas, from cached sums)."""
        if not cf.ids:
            return 0.0
        p = self.p
        a, b = self.own_line
        t = cf.full / p + self.fixed
        own = (cf.lin + a * cf.tok) / p + b
        if cf.kids is not None:
            return t + min(own, max(self.cp.child_time(k.size, k.lin, k.tok) for k in cf.kids))
        return t + own

    def without(self, a: int, cf: _Config | None = None) -> _Config:
        cf = cf or self.config
        c = self.ctx
        n, lin = c.length_of[a], c.linear[a]
        kids = None
        if cf.kids is not None:
            kids = [
                k
                if a not in k.members
                else _Kid(k.size, [s for s in k.members if s != a], k.lin - lin, k.tok - n, k.rtok - ceil_div(n, k.size))
                for k in cf.kids
            ]
        return _Config([s for s in cf.ids if s != a], cf.tok - n, cf.lin - lin, cf.full - c.full[a], cf.rtok - ceil_div(n, self.p), kids)

    def with_(self, a: int, cf: _Config | None = None) -> _Config | None:
        """Add `a`; None if it does not fit the token budget. It joins the child where it finishes earliest."""
        cf = cf or self.config
        c = self.ctx
        budget, n, lin = c.cluster.tokens_per_rank, c.length_of[a], c.linear[a]
        if cf.rtok + ceil_div(n, self.p) > budget:
            return None
        kids = None
        if cf.kids is not None and n <= c.node_cap:
            best, best_t = -1, float("inf")
            for i, k in enumerate(cf.kids):
                if k.rtok + ceil_div(n, k.size) > budget:
                    continue
                t = self.cp.child_time(k.size, k.lin + lin, k.tok + n)
                if t < best_t:
                    best, best_t = i, t
            if best >= 0:
                k = cf.kids[best]
                kids = list(cf.kids)
                kids[best] = _Kid(k.size, k.members + [a], k.lin + lin, k.tok + n, k.rtok + ceil_div(n, k.size))
        return _Config(cf.ids + [a], cf.tok + n, cf.lin + lin, cf.full + c.full[a], cf.rtok + ceil_div(n, self.p), kids)


class _Context:
    def __init__(self, length_of, cluster: Cluster, cost: CostModel):
        self.length_of, self.cluster, self.cost = length_of, cluster, cost
        self.node_cap = cluster.gpus_per_node * cluster.tokens_per_rank
        ids = list(length_of)
        lens = np.array([length_of[s] for s in ids], dtype=np.float64)
        self.linear = dict(zip(ids, map(float, cost.linear_cost(lens))))
        self.full = dict(zip(ids, map(float, cost.full_cost(lens))))
        self.scost = dict(zip(ids, map(float, cost.sample_cost(lens))))
        self._cps: dict[int, ChildProblem] = {}

    def cp(self, parent_size: int) -> ChildProblem:
        if parent_size not in self._cps:
            self._cps[parent_size] = child_problem([], parent_size, self.cluster, self.cost)
        return self._cps[parent_size]


def rebalance_parents(groups: tuple[Group, ...], length_of: dict[int, int], cluster: Cluster, cost: CostModel, **kw) -> tuple[Group, ...]:
    """rebalance() of parents without children given: wide parents' children are solved first."""
    return tuple(g for g, _ in rebalance([(g, None) for g in groups], length_of, cluster, cost, **kw))


def rebalance(
    start: Sequence[tuple[Group, Kids | None]],
    length_of: dict[int, int],
    cluster: Cluster,
    cost: CostModel,
    max_moves: int | None = None,
    n_samples: int = 10,
    n_targets: int = 6,
    window: int = 16,
    min_gain: float = 3e-4,
) -> tuple[tuple[Group, Kids | None], ...]:
    """Moves and swaps out of the slowest parent while they lower it and keep every other
    parent below it. Returns the parents with their children (None: a node-local parent, or a
    wide one whose children could not be formed), in the input order.

    Bounded, since planning must hide under a training step: at most max_moves moves, and it
    stops once the last `window` moves together gained less than `min_gain` of the step time."""
    ctx = _Context(length_of, cluster, cost)
    states = [_GroupState(g, list(g.samples), ctx, kids) for g, kids in start]
    max_moves = min(2 * len(states) + 32, 160) if max_moves is None else max_moves
    times = np.array([s.time for s in states])
    history = []  # the step time before each move
    for _ in range(max_moves):
        worst = int(np.argmax(times))
        cur = times[worst]
        history.append(cur)
        if len(history) > window and history[-window - 1] - cur < min_gain * cur:
            break
        src = states[worst]
        by_cost = sorted(src.config.ids, key=lambda s: -ctx.scost[s])
        # a spread of sizes: large samples move much load, small ones fine-tune
        picks = sorted(set(np.linspace(0, len(by_cost) - 1, min(n_samples, len(by_cost))).round().astype(int)))
        cands = [by_cost[i] for i in picks]
        near = np.argpartition(times, min(n_targets, len(times) - 1))[: n_targets + 1]
        targets = [int(k) for k in sorted(near, key=lambda k: (times[k], k)) if k != worst][:n_targets]
        # swap partners come from each target's members, costliest first
        ranked = {k: sorted(states[k].config.ids, key=lambda b: -ctx.scost[b]) for k in targets}
        best = None
        for a in cands:
            out_w = src.without(a)
            t_worst = src.price(out_w)
            if t_worst >= cur:
                continue
            ca = ctx.scost[a]
            for k in targets:
                dst = states[k]
                moved = dst.with_(a)
                if moved is not None:
                    t = max(t_worst, dst.price(moved))
                    if t < cur * (1 - 1e-9) and (best is None or t < best[0]):
                        best = (t, k, out_w, moved)
                for b in [b for b in ranked[k] if ctx.scost[b] < ca][:2]:
                    into_k = dst.with_(a, dst.without(b))
                    into_w = src.with_(b, out_w)
                    if into_k is None or into_w is None:
                        continue
                    t = max(src.price(into_w), dst.price(into_k))
                    if t < cur * (1 - 1e-9) and (best is None or t < best[0]):
                        best = (t, k, into_w, into_k)
        if best is None:
            break
        _, k, new_w, new_k = best
        src.set(new_w.ids, new_w)
        states[k].set(new_k.ids, new_k)
        times[worst], times[k] = src.time, states[k].time
    return tuple(
        (
            Group(s.group.start, s.group.size, tuple(s.config.ids)),
            None if s.config.kids is None else tuple((k.size, tuple(k.members)) for k in s.config.kids),
        )
        for s in states
    )
