"""The width-choosing parent solver (mode "repack+widths"): parents may change width and share.

The paper's parent solver (parent_solver) moves and swaps samples between parents whose widths
the parent assignment chose: each long sample anchors a parent of the width its cost share asked for.
This solver starts from its plan and changes the widths too, by a local search on the slowest
parent S (the step's time is the slowest parent's):

- narrow: S at half its width (the freed half one more parent, or single ranks), when its
  longest sample's memory floor allows;
- widen: S at twice its width, taking the ranks of the fastest parents (their samples join);
- merge: S and another parent of its width with a long sample into one parent of twice the
  width, each long sample in a node-local child of its own (two long samples sharing a wide
  parent: their full attention spreads over both halves);
- refill: S and such a parent keep their widths and share their short samples afresh.

A candidate re-places only the samples of the parents it changes (the parent solver's joint fill,
parent_solver._BinFill, on those parents alone), then solves each new wide parent's children;
it is taken only if every parent it makes is faster than S was. The search's result is kept only
if its whole step (PlanEstimate.step_time, the step the simulator charges) is no slower than the
input's, so the result is never estimated slower than the input. Positions do not enter the prices:
parents are laid out widest first at the end (power-of-two widths stay aligned), and a wide
parent's node-local children inside it.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Sequence

import numpy as np

from .children import polish_children, solve_children
from .cluster import Cluster, Sample
from .cost import CostModel
from .estimate import PlanEstimate
from .layout import Group
from .parent_solver import _anchor_child, _BinFill, _child_pays
from .plan import DISABLED, NODE_LOCAL, ParentPlan

# local-search rounds at most (each improves the slowest parent, or the search stops)
MAX_ROUNDS = 64
# a candidate must beat the slowest parent by this relative margin (float noise is no gain)
MIN_GAIN = 1e-9


class _Search:
    def __init__(self, samples: Sequence[Sample], cluster: Cluster, cost: CostModel, est: PlanEstimate):
        self.cluster, self.cost, self.est = cluster, cost, est
        self.length_of = est.length_of
        self.node = cluster.gpus_per_node
        self.widest = cost.widest_group(cluster)
        ids = np.fromiter((s.id for s in samples), dtype=np.int64, count=len(samples))
        self._est_rows = est.cost is cost and np.array_equal(ids, est._ids)  # the planner's: the estimate's rows are the samples'
        if self._est_rows:  # its terms
            lengths, self.tokenwise, self.full = est._len.astype(np.int64), est._tokenwise, est._full
        else:
            self._ids = ids.tolist()
            lengths = np.array([s.length for s in samples], dtype=np.int64)
            self.tokenwise = np.asarray(cost.tokenwise_cost(lengths), dtype=np.float64)
            self.full = np.asarray(cost.full_cost(lengths), dtype=np.float64)
        self.lengths = lengths
        self.sample_cost = self.tokenwise + self.full  # cost.sample_cost
        self.target = float(self.sample_cost.sum()) / cluster.world_size  # the per-rank share the anchor rules use

    @functools.cached_property
    def index(self) -> dict[int, int]:
        """Sample id -> its row in the per-sample arrays (made when a move first reads it)."""
        return self.est._row if self._est_rows else {s: i for i, s in enumerate(self._ids)}

    # ----- pricing ----------------------------------------------------------------------------------
    def parent(self, size: int, ids: Sequence[int], kids=None) -> tuple[ParentPlan, float]:
        """A parent of `size` holding `ids` laid out from rank 0 (positions are set at the end),
        its children polished from `kids` ((size, ids) per child) or solved, and its
        PlanEstimate time."""
        g = Group(0, size, tuple(ids))
        if size <= self.node:
            pp = ParentPlan(g, (g,), NODE_LOCAL)
        elif kids is not None:
            pp = ParentPlan(g, *polish_children(g, kids, self.length_of, self.cluster, self.cost))
        else:
            pp = ParentPlan(g, *solve_children(g, self.length_of, self.cluster, self.cost))
        return pp, self.est.parent_time(pp)

    def floor(self, s: int) -> int:
        return self.cluster.min_group_size(self.length_of[s])

    def longest(self, p: ParentPlan) -> int | None:
        ids = p.group.samples
        return max(ids, key=lambda s: (self.length_of[s], -s)) if ids else None

    # ----- a candidate: new parents for a pool of samples -----------------------------------------
    def refill(self, sizes: list[int], anchors: list[list[int]], pool: Sequence[int]) -> list[tuple[ParentPlan, float]] | None:
        """Parents of `sizes` with their `anchors` (sample ids per parent) placed first, then the rest
        of `pool` longest first where it finishes earliest (the joint fill's bins: a wide parent's
        anchors in node-local children sized by the anchor rules, single ranks for the rest). None
        when a sample finds no room."""
        pool = list(pool)
        local = {s: k for k, s in enumerate(pool)}
        idx = np.array([self.index[s] for s in pool], dtype=np.int64)
        fill = _BinFill(self.cluster, self.cost, self.tokenwise[idx], self.full[idx], self.lengths[idx])
        node_cap = self.node * self.cluster.tokens_per_rank
        placed = set()
        for size, anch in zip(sizes, anchors):
            kids = None
            if size > self.node and anch and all(self.length_of[s] <= node_cap for s in anch):
                cs = []
                for s in anch:
                    i = self.index[s]
                    n, tw, full = int(self.lengths[i]), float(self.tokenwise[i]), float(self.full[i])
                    pays = _child_pays(n, tw, full, size, self.node, self.cost, self.target)
                    cs.append(_anchor_child(n, tw, full, size, self.cluster, self.cost, self.target) if pays else 0)
                if all(cs) and sum(cs) <= size:
                    kids = cs + [1] * (size - sum(cs))
            bins = fill.add_parent(size, kids)
            for j, s in enumerate(anch):
                fill.add(bins[j] if kids is not None else bins[0], local[s])
                placed.add(s)
        rest = sorted((s for s in pool if s not in placed), key=lambda s: -self.sample_cost[self.index[s]])
        if fill.place_all([local[s] for s in rest])[0] >= 0:
            return None
        out, names = [], np.array(pool, dtype=np.int64)
        members, bin_members = fill.members(names), None
        for k, size in enumerate(sizes):
            bins = [b for b in range(len(fill.bin_parent)) if fill.bin_parent[b] == k]
            kids = None
            if size > self.node and len(bins) > 1:
                bin_members = bin_members or fill.members(names, of_bins=True)
                kids = tuple((fill.bin_size[b], bin_members[b]) for b in bins)
            out.append(self.parent(size, members[k], kids))
        return out

    # ----- moves around the slowest parent -------------------------------------------------------
    def candidates(self, parents: list[ParentPlan], si: int, times: np.ndarray, sizes: np.ndarray):
        """(indices of the parents replaced, sizes, anchors) of each move on parents[si]; `times`
        and `sizes`: every parent's, as arrays."""
        s = parents[si]
        a = self.longest(s)
        if a is None:
            return
        w = s.group.size
        longs = sorted((x for x in s.group.samples if self.floor(x) > 1 and x != a), key=lambda x: -self.length_of[x])
        if w > 1 and self.floor(a) <= w // 2:  # narrow
            second = [longs[0]] if longs and self.floor(longs[0]) <= w // 2 else []
            yield [si], [w // 2, w // 2], [[a], second]
            yield [si], [w // 2] + [1] * (w // 2), [[a]] + [[] for _ in range(w // 2)]
        others = np.arange(len(parents)) != si
        if 2 * w <= self.widest:  # widen, on the fastest parents' ranks (at most w parents of them)
            need, donors = w, []
            for k in _fastest(times, others & (sizes <= w), 2 * w):
                if parents[k].group.size <= need:
                    donors.append(k)
                    need -= parents[k].group.size
                    if need == 0:
                        break
            if need == 0:
                yield [si] + donors, [2 * w], [[a] + longs[:1]]
        # the fastest two of its width holding a sample wider than a rank (an SP1 parent holds none:
        # its samples fit one rank's budget)
        same = np.flatnonzero(others & (sizes == w)) if w > 1 else np.zeros(0, dtype=np.int64)
        same = same[np.lexsort((same, times[same]))].tolist()
        partners = list(itertools.islice((k for k in same if parents[k].group.samples and self.floor(self.longest(parents[k])) > 1), 2))
        for k in partners:  # merge with, or share the short samples of, the fastest parents of its width
            b = self.longest(parents[k])
            if 2 * w <= self.widest:
                yield [si, k], [2 * w], [[a, b]]
            yield [si, k], [w, w], [[a], [b]]

    def improve(self, parents: list[ParentPlan], times: Sequence[float]) -> list[ParentPlan]:
        """Parents (and their PlanEstimate times) after the search's moves: the ones it keeps in
        their order, then the new ones."""
        times = np.array(times, dtype=np.float64)
        sizes = np.fromiter((p.group.size for p in parents), dtype=np.int64, count=len(parents))
        for _ in range(MAX_ROUNDS):
            si = int(np.argmax(times))  # the first slowest
            slowest = float(times[si])
            best, best_t = None, slowest * (1 - MIN_GAIN)
            for replaced, new_sizes, anchors in self.candidates(parents, si, times, sizes):
                pool = [x for k in replaced for x in parents[k].group.samples]
                new = self.refill(new_sizes, anchors, pool)
                if new is None:
                    continue
                t = max(t for _, t in new)
                if t < best_t:
                    best, best_t = (replaced, new), t
            if best is None:
                break
            replaced, new = best
            for k in sorted(replaced, reverse=True):  # the others keep their order; the new ones go last
                del parents[k]
            parents += [pp for pp, _ in new]
            keep = np.ones(len(times), dtype=bool)
            keep[replaced] = False
            times = np.concatenate([times[keep], [t for _, t in new]])
            sizes = np.concatenate([sizes[keep], np.array([pp.group.size for pp, _ in new], dtype=np.int64)])
        return parents


def _fastest(times: np.ndarray, mask: np.ndarray, n: int) -> list[int]:
    """The n parents of `mask` with the least time, ties by index (heapq.nsmallest's answer over
    them in index order), without sorting them all."""
    idx = np.flatnonzero(mask)
    if len(idx) > n:
        t = times[idx]
        idx = idx[t <= np.partition(t, n - 1)[n - 1]]  # the n least, and any tied with the last
    return idx[np.lexsort((idx, times[idx]))][:n].tolist()


def _laid_out(parents: list[ParentPlan], cluster: Cluster) -> tuple[ParentPlan, ...]:
    """Parents widest first from rank 0; each one's children shifted with it (a wide parent starts
    on a node boundary, so its node-local children stay node-local). A parent that lands where its
    plan lies already is kept as it is."""
    out, at = [], 0
    for p in sorted(parents, key=lambda p: -p.group.size):
        size = p.group.size
        if at == p.group.start and (p.reason or p.repacked):
            out.append(p)
        else:
            shift = at - p.group.start
            g = Group(at, size, p.group.samples)
            if p.repacked:
                kids = tuple(Group(c.start + shift, c.size, c.samples) for c in p.children)
                out.append(ParentPlan(g, kids, p.reason))
            else:
                reason = p.reason or (NODE_LOCAL if size <= cluster.gpus_per_node else DISABLED)
                out.append(ParentPlan(g, (g,), reason))
        at += size
    return tuple(out)


def solve_widths(
    start: Sequence[ParentPlan],
    samples: Sequence[Sample],
    cluster: Cluster,
    cost: CostModel,
    est: PlanEstimate | None = None,
    times: Sequence[float] | None = None,
) -> tuple[ParentPlan, ...]:
    """The width-choosing parent solver from `start` (the paper's parent solver's plan): never
    estimated slower than it. `est` and `times` (start's parent times under it): the step's
    PlanEstimate and start's times, if the caller has them."""
    cost = cost.for_cluster(cluster)
    est = est or PlanEstimate({s.id: s.length for s in samples}, cluster, cost)
    search = _Search(samples, cluster, cost, est)
    start = tuple(start)
    times = est.parent_times(start).tolist() if times is None else list(times)
    improved = _laid_out(search.improve(list(start), times), cluster)
    if len(improved) == len(start) and all(map(operator.is_, improved, start)):
        return start  # nothing moved: the same parents where they were
    # the search lowers the slowest parent; kept only if the whole step (PlanEstimate.step_time, the
    # router's barrier and every layer's synchronizations included) is no slower
    return improved if est.step_time(improved) <= est.step_time(start) else start
