"""Halo children, the parent's own layout with halo attention, and the per-parent choice of how a
wide parent's sparse layers run.

A *halo child* (Group.halo) runs its sparse attention on its own token layout: each rank holds
contiguous chunks of its samples, with all heads, and receives from the ranks before it the keys
and values its queries reach back to (the sparse kind's reach, `first_key`: a sliding window of W
reaches W - 1 tokens back, a chunked kind back to its chunk's start), one exchange per layer; in
the backward the halos' key/value gradients go back to their owners. The layout change into and
out of halo children rides on the full layers' entry and exit all-to-alls, as repacking's does.

- mode `halo` (solve_halo_children): a wide parent's long samples are cut over as many contiguous
  ranks as balance wants (at least what the token budget needs, at most the parent, across nodes
  if need be), one sample a halo child; the rest sit whole on single ranks, which exchange nothing.
- mode `parent+halo` (own_layout_halo): the naive variant, the parent's own token layout (every
  sample cut over all its ranks, as context parallelism over packed sequences does) with halo
  attention: a short sample's halo reaches back over most of it.
- mode `choose` (choose_children): per wide parent the cheapest of its own layout (Ulysses in the
  parent), repack's node-local Ulysses children, halo children, and the mix of repack's children
  each running Ulysses or halo, whichever is cheaper; all priced by parent_time here.

Every candidate is priced by solver.reference.parent_time, the one definition of a parent's time
(a halo child by its slowest rank's halo exchanges, solver.reference.halo_pass), so the choice is the cost model's.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from .cluster import Cluster, ceil_div
from .cost import CostModel
from .layout import Group, Way
from .plan import ParentPlan
from .reference import child_time, halo_pass, parent_time, per_sample

HALO_PARENT = "its own layout; sparse layers by halo exchange (parent+halo)"
HALO_TARGET_SCALES = (1.0, 0.75, 1.5, 0.5, 2.0)  # per-rank targets (the parent's mean load x these) the halo solver tries


def passing_way(child: Group, length_of: Mapping[int, int], cost: CostModel) -> Group:
    """A halo child run the cheapest of the ways its kind can run one (SparseKind.halo_ways: a
    linear kind's states by the chain or every earlier map to each later chunk in one round), as
    solver.reference.halo_pass prices them, the first of equals; any other group as it is."""
    ways = cost.sparse.halo_ways
    if not child.halo or child.size == 1 or len(ways) == 1:  # no choice to price
        return child
    return min((replace(child, way=w) for w in ways), key=lambda c: halo_pass(c, length_of, cost))


def own_layout_halo(parent: Group, length_of: Mapping[int, int] | None = None, cost: CostModel | None = None) -> ParentPlan:
    """The parent's own token layout, its sparse layers by halo exchange (the naive variant); a
    linear kind's states passed the cheaper way where the lengths and the cost model are given."""
    child = Group(parent.start, parent.size, parent.samples, Way.HALO)
    return ParentPlan(parent, (child if cost is None else passing_way(child, length_of, cost),), HALO_PARENT)


def _place(sizes: list[int], parent: Group, gpus_per_node: int) -> list[int]:
    """Offsets in the parent of contiguous ranges of `sizes` (in decreasing order) that tile it:
    the ranges wider than a node one after the other from its first rank, then each narrower
    one inside one node where a run of free ranks holds it (first fit), else in the first free run
    anywhere; ranges of one rank take what is left, in order. Where no free run is left for a
    range, every range one after the other, in the given order."""
    g, taken = gpus_per_node, [False] * parent.size
    starts, at = [0] * len(sizes), 0

    def take(i: int, lo: int) -> None:
        starts[i] = lo
        taken[lo : lo + sizes[i]] = [True] * sizes[i]

    def free_run(m: int, lo: int, hi: int):
        return next((r for r in range(lo, hi - m + 1) if not any(taken[r : r + m])), None)

    for i, m in enumerate(sizes):
        if m > g:
            take(i, at)
            at += m
    for i, m in enumerate(sizes):
        if 1 < m <= g:
            lo = next((r for n in range(parent.size // g) if (r := free_run(m, n * g, (n + 1) * g)) is not None), None)
            lo = lo if lo is not None else free_run(m, 0, parent.size)
            if lo is None:  # the free ranks are scattered: every range one after the other, widest first
                return [int(x) for x in np.cumsum([0, *sizes[:-1]])]
            take(i, lo)
    singles = iter(r for r in range(parent.size) if not taken[r])
    for i, m in enumerate(sizes):
        if m == 1:
            take(i, next(singles))
    return starts


def _halo_children_for(
    parent: Group, ids: list[int], length_of: Mapping[int, int], cluster: Cluster, cost: CostModel, target: float, tw: Mapping[int, float]
):
    """Halo children for a per-rank target load, or None: every sample whose load passes the
    target, or whose length the token budget cannot hold, gets contiguous ranks of its own
    (ceil(load / target), at least its memory floor), fewest extra ranks given up first when they
    do not fit; the rest go whole to single ranks, largest first to the least loaded that holds it.
    `tw`: each sample's cost.tokenwise_cost."""
    budget, p = cluster.tokens_per_rank, parent.size
    floor = {s: ceil_div(length_of[s], budget) for s in ids}
    # at most a rank per token (no empty chunk) and the parent's ranks
    want = {s: min(p, length_of[s], max(floor[s], int(np.ceil(tw[s] / target - 1e-9)) if target > 0 else 1)) for s in ids}
    cut = [s for s in ids if want[s] > 1]
    while sum(want[s] for s in cut) > p:
        can = [s for s in cut if want[s] > floor[s]]
        if not can:
            return None
        pick = min(can, key=lambda s: tw[s] / (want[s] - 1))  # gives up the least per rank
        want[pick] -= 1
        cut = [s for s in cut if want[s] > 1]
    singles = p - sum(want[s] for s in cut)
    rest = [s for s in ids if s not in cut]
    if rest and singles == 0:
        return None
    heap = [(0.0, k) for k in range(singles)]  # (load, single rank)
    held: list[list[int]] = [[] for _ in range(singles)]
    tokens = [0] * singles
    for s in rest:  # largest first (ids are longest first)
        skipped = []
        while heap and tokens[heap[0][1]] + length_of[s] > budget:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        load, k = heapq.heappop(heap)
        held[k].append(s)
        tokens[k] += length_of[s]
        heapq.heappush(heap, (load + tw[s], k))
        for e in skipped:
            heapq.heappush(heap, e)
    groups = [(want[s], (s,), True) for s in cut] + [(1, tuple(h), False) for h in held]
    groups.sort(key=lambda x: -x[0])
    starts = _place([m for m, _, _ in groups], parent, cluster.gpus_per_node)
    kids = [
        passing_way(Group(parent.start + st, m, samples, Way.HALO if halo else Way.ULYSSES), length_of, cost)
        for st, (m, samples, halo) in zip(starts, groups)
    ]
    return tuple(sorted(kids, key=lambda c: c.start))


class _Prices:
    """solver.reference.parent_time of one parent with given children, each set of children
    priced once: the halo solver's targets often give the same children, and choose_children
    prices again what it solved."""

    def __init__(self, parent: Group, length_of: Mapping[int, int], cost: CostModel):
        self.parent, self.length_of, self.cost = parent, length_of, cost
        self._plan: dict[tuple[Group, ...], float] = {}

    def __call__(self, children: tuple[Group, ...], below: float = math.inf) -> float:
        """parent_time of the parent with these children; with `below`, a time at least `below`
        where the children reach it (parent_time's bound), kept only where exact."""
        t = self._plan.get(children)
        if t is None:
            t = parent_time(ParentPlan(self.parent, children), self.length_of, self.cost, below)
            if t < below:
                self._plan[children] = t
        return t


def solve_halo_children(
    parent: Group,
    length_of: Mapping[int, int],
    cluster: Cluster,
    cost: CostModel,
    priced: _Prices | None = None,
    bounded: bool = False,
) -> tuple[tuple[Group, ...], str]:
    """Halo children for a wide parent (the best of a few per-rank targets), or its own layout with
    the reason when none fits the token budget or halo children do not beat it. `priced`: the
    parent's prices (_Prices), shared with a caller that prices its children too.

    bounded: each target's children are priced only as far as it takes to see them reach the best
    so far or the own layout (parent_time's `below`), which cannot change the answer (a candidate
    is kept only where it is strictly faster than both); the time the reason quotes when the own
    layout wins may then be such a bound (choose_children discards that reason)."""
    cost = cost.for_cluster(cluster)
    priced = _Prices(parent, length_of, cost) if priced is None else priced
    cost.sparse.check_local()
    ids = sorted(parent.samples, key=lambda s: (-length_of[s], s))
    tw = dict(zip(ids, per_sample(cost.tokenwise_cost, ids, length_of)))
    mean = sum(tw[s] for s in ids) / parent.size
    own = priced((parent,))
    best, best_t = None, math.inf
    for scale in HALO_TARGET_SCALES:
        kids = _halo_children_for(parent, ids, length_of, cluster, cost, scale * mean, tw)
        if kids is not None:
            t = priced(kids, min(best_t, own)) if bounded else priced(kids)
            if t < best_t:
                best, best_t = kids, t
    if best is None:
        return (parent,), "no halo children fit the token budget"
    if best_t >= own:
        return (parent,), f"halo children do not pay: {best_t * 1e3:.1f} ms vs {own * 1e3:.1f} ms in the parent layout (estimated)"
    return best, "" if ParentPlan(parent, best).repacked else HALO_PARENT  # one sample over every rank: its own layout


def choose_children(
    parent: Group, repack: tuple[tuple[Group, ...], str], length_of: Mapping[int, int], cluster: Cluster, cost: CostModel
) -> ParentPlan:
    """The cheapest of the parent's own layout (Ulysses, or halo attention: parent+halo's), repack's
    children (`repack`, as the child solver left them), halo children, and the mix of repack's
    children each as Ulysses or as halo."""
    cost = cost.for_cluster(cluster)
    priced = _Prices(parent, length_of, cost)
    cands = [ParentPlan(parent, (parent,), "the parent layout is the cheapest (choose)")]
    kids, reason = repack
    if not reason:
        cands.append(ParentPlan(parent, kids))
        if cost.sparse.first_key is not None:
            mixed = tuple(
                min(
                    (c, passing_way(Group(c.start, c.size, c.samples, Way.HALO), length_of, cost)),
                    key=lambda k: child_time(k, parent, length_of, cost),
                )
                if c.size > 1
                else c
                for c in kids
            )
            cands.append(ParentPlan(parent, mixed))
    if cost.sparse.first_key is not None:
        halo_kids, halo_reason = solve_halo_children(parent, length_of, cluster, cost, priced, bounded=True)
        if halo_kids != (parent,):
            cands.append(ParentPlan(parent, halo_kids, halo_reason))
        cands.append(own_layout_halo(parent, length_of, cost))
    return min(cands, key=lambda pp: priced(pp.children))
