"""Baseline parent assignment: balanced SP groups of mixed widths (FlexSP / dynamic-CP style).

Heuristic, not a MILP: (1) each sample gets a width from its memory floor and its share of the
step's cost; samples wider than one rank anchor their own group; (2) anchor groups are laid out
widest first (power-of-two widths laid out in decreasing order stay aligned) and the remaining
ranks become SP1 groups; (3) the other samples go, longest first, to the group whose per-rank
cost stays lowest, within the token budget.

The parent solver's start (assign_with_children) shares steps (1) and (2) and fills bins that
know their real cost: node-local groups, and the children of parents wider than a node.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from .cluster import Cluster, PlanError, Sample, ceil_div, ceil_pow2_array, check_samples
from .cost import CostModel
from .layout import Group


def _widest_group(world_size: int) -> int:
    w = 1
    while w * 2 <= world_size:
        w *= 2
    return w


def anchor_widths(costs: np.ndarray, floors: np.ndarray, capacity: int, widest: int) -> np.ndarray:
    """Widths for each item (1 = not an anchor) whose anchors fit `capacity` ranks.

    An item's width is its memory floor or its cost share (cost / (total / capacity)), whichever
    is larger, as a power of two. If the anchors need more than `capacity` ranks, the anchor whose
    per-rank cost grows least is halved until they fit (never below its floor).
    """
    target = costs.sum() / capacity
    share = ceil_pow2_array(costs / target) if target > 0 else np.ones(len(costs), dtype=np.int64)
    widths = np.minimum(widest, np.maximum(floors, share))
    anchored = widths > 1
    while widths[anchored].sum() > capacity:
        can = np.nonzero(anchored & (widths > floors))[0]
        if len(can) == 0:
            raise PlanError(
                f"the batch does not fit: its long samples need {int(widths[anchored].sum())} ranks "
                f"at their memory floors but only {capacity} are available"
            )
        pick = can[np.argmin(costs[can] / (widths[can] // 2))]
        widths[pick] //= 2
        anchored = widths > 1
    return widths


class _GroupFill:
    """Groups with per-rank load and token counts; picks the best group for each new sample."""

    def __init__(self, groups: list[tuple[int, int]], budget: int, comm_per_token: dict[int, float]):
        self.comm_per_token = comm_per_token  # width -> exchange seconds per token of the group
        self.start = [s for s, _ in groups]
        self.size = [w for _, w in groups]
        self.load = [0.0] * len(groups)
        self.tokens = [0] * len(groups)  # per-rank tokens, counting ceil(L / size) per sample
        self.members: list[list[int]] = [[] for _ in groups]
        self.budget = budget
        self.heaps: dict[int, list[tuple[float, int]]] = {}
        for i, w in enumerate(self.size):
            self.heaps.setdefault(w, []).append((0.0, i))

    def add(self, i: int, item: int, cost: float, length: int) -> None:
        self.load[i] += (cost + self.comm_per_token[self.size[i]] * length) / self.size[i]
        self.tokens[i] += ceil_div(length, self.size[i])
        self.members[i].append(item)

    def place(self, item: int, cost: float, length: int) -> int:
        best, best_key = -1, float("inf")
        for w, heap in self.heaps.items():
            skipped = []
            while heap:
                load, i = heap[0]
                if load != self.load[i]:  # stale entry
                    heapq.heapreplace(heap, (self.load[i], i))
                    continue
                if self.tokens[i] + ceil_div(length, w) <= self.budget:
                    break
                skipped.append(heapq.heappop(heap))
            if heap:
                key = self.load[heap[0][1]] + (cost + self.comm_per_token[w] * length) / w
                if key < best_key:
                    best, best_key = heap[0][1], key
            for e in skipped:
                heapq.heappush(heap, e)
        if best < 0:
            return -1
        self.add(best, item, cost, length)  # its heap entry is stale now and is re-keyed when it surfaces
        return best


def exchange_cost_per_token(cluster: Cluster, cost: CostModel) -> dict[int, float]:
    """Width -> training seconds of exchanges per token the group holds, every layer running in
    the group's own layout (FlexSP prices this too)."""
    out, w = {}, 1
    while w <= cluster.world_size:
        out[w] = cost.child_line(w, w)[0]
        w *= 2
    return out


PRICINGS = ("compute", "comm")

# A parent's children before layout: (child size, sample ids) in rank order; None = own layout.
Kids = tuple[tuple[int, tuple[int, ...]], ...]


def _anchor_groups(samples, cluster: Cluster, cost: CostModel):
    """Per-sample arrays, anchor widths, and the groups laid out widest first: (start, width)
    per anchor, in `anchors` order, then SP1 groups over the remaining ranks."""
    lengths = np.array([s.length for s in samples], dtype=np.int64)
    costs = np.asarray(cost.sample_cost(lengths), dtype=np.float64)
    floors = ceil_pow2_array(lengths / cluster.tokens_per_rank)  # memory floors (Cluster.min_group_size)
    widest = _widest_group(cluster.world_size)
    widths = anchor_widths(costs, floors, cluster.world_size, widest)
    anchors = sorted(np.nonzero(widths > 1)[0], key=lambda i: (-widths[i], -costs[i]))
    groups, at = [], 0
    for i in anchors:
        groups.append((at, int(widths[i])))
        at += int(widths[i])
    groups += [(r, 1) for r in range(at, cluster.world_size)]
    rest = sorted(np.nonzero(widths == 1)[0], key=lambda i: -costs[i])
    return lengths, costs, anchors, groups, rest


def _unplaceable(samples, i: int, lengths: np.ndarray, cluster: Cluster) -> PlanError:
    return PlanError(
        f"sample id={samples[i].id} of length={int(lengths[i])} cannot be placed: no group has "
        f"{int(lengths[i])} free tokens left under tokens_per_rank={cluster.tokens_per_rank}; "
        f"the batch ({int(lengths.sum())} tokens) is too large for {cluster.world_size} ranks"
    )


def assign_parents(samples: Sequence[Sample], cluster: Cluster, cost: CostModel, pricing: str = "compute") -> tuple[Group, ...]:
    """Parent groups covering every rank; every sample placed exactly once (or PlanError).

    pricing: what the fill balances. "compute" (the design's baseline): full attention ~L^2 plus
    token-wise work ~L, divided over the group. "comm": also each group's own all-to-alls, as
    FlexSP's cost model does; a stronger baseline that gives wide groups fewer short samples."""
    if pricing not in PRICINGS:
        raise PlanError(f"pricing={pricing!r}; valid: {PRICINGS}")
    samples = check_samples(samples, cluster)
    lengths, costs, anchors, groups, rest = _anchor_groups(samples, cluster, cost)
    if pricing == "comm":
        comm = exchange_cost_per_token(cluster, cost)
    else:
        comm = {w: 0.0 for w in exchange_cost_per_token(cluster, cost)}
    fill = _GroupFill(groups, cluster.tokens_per_rank, comm)
    for gi, i in enumerate(anchors):
        fill.add(gi, int(i), float(costs[i]), int(lengths[i]))
    for i in rest:
        if fill.place(int(i), float(costs[i]), int(lengths[i])) < 0:
            raise _unplaceable(samples, i, lengths, cluster)
    return tuple(Group(fill.start[k], fill.size[k], tuple(samples[i].id for i in fill.members[k])) for k in range(len(groups)))


class _BinFill:
    """Longest-first fill into bins that know what they cost: a node-local group is one bin;
    a parent wider than a node is one bin per child (its sparse layers' layout).

    A bin's time is its parent's shared part (full attention over the parent's ranks, and the
    fixed cost of its full-layer exchanges) plus its own: (linear + per-token x tokens) / size +
    fixed, the terms of estimate.group_time. A sample joining a parent raises every bin of that
    parent by its full attention share, so heap keys go stale; they only grow, and a stale top
    is re-keyed when it is looked at."""

    def __init__(self, cluster: Cluster, cost: CostModel, linear: np.ndarray, full: np.ndarray, lengths: np.ndarray):
        self.cost, self.budget = cost, cluster.tokens_per_rank
        self.linear, self.full, self.lengths = linear, full, lengths
        self.p_size, self.p_base, self.p_full, self.p_rtok, self.p_members = [], [], [], [], []
        self.b_parent, self.b_size, self.b_pt, self.b_fixed, self.b_lin, self.b_tok, self.b_rtok, self.b_members = ([] for _ in range(8))
        # one heap per kind of bin (parent size, bin size, own layout): its least-loaded bin
        # with room is the only one of that kind a sample has to look at
        self.b_kind: list[tuple[int, int, bool]] = []
        self.heaps: dict[tuple[int, int, bool], list[tuple[float, int]]] = {}

    def add_parent(self, size: int, child_sizes: list[int] | None) -> list[int]:
        """A parent of `size` ranks with children of `child_sizes` (None: its own layout, one
        bin of all its ranks); returns its bins."""
        p = len(self.p_size)
        self.p_size.append(size)
        self.p_full.append(0.0)
        self.p_rtok.append(0)
        self.p_members.append([])
        self.p_base.append(self.cost.parent_fixed(size))
        bins = []
        for c in child_sizes or [size]:
            b = len(self.b_size)
            pt, fixed = self.cost.child_line(c, size)
            self.b_parent.append(p)
            self.b_size.append(c)
            self.b_pt.append(pt)
            self.b_fixed.append(fixed)
            self.b_lin.append(0.0)
            self.b_tok.append(0)
            self.b_rtok.append(0)
            self.b_members.append([])
            self.b_kind.append((size, c, child_sizes is None))
            bins.append(b)
            heapq.heappush(self.heaps.setdefault(self.b_kind[b], []), (self.load(b), b))
        return bins

    def load(self, b: int) -> float:
        p, c = self.b_parent[b], self.b_size[b]
        return self.p_base[p] + self.p_full[p] / self.p_size[p] + (self.b_lin[b] + self.b_pt[b] * self.b_tok[b]) / c + self.b_fixed[b]

    def add(self, b: int, i: int) -> None:
        p, n = self.b_parent[b], int(self.lengths[i])
        self.p_full[p] += float(self.full[i])
        self.p_rtok[p] += ceil_div(n, self.p_size[p])
        self.p_members[p].append(i)
        self.b_lin[b] += float(self.linear[i])
        self.b_tok[b] += n
        self.b_rtok[b] += ceil_div(n, self.b_size[b])
        self.b_members[b].append(i)

    def place(self, i: int) -> int:
        """Put sample i where the bin it joins finishes earliest; -1 if no bin has room."""
        n, lin, full = int(self.lengths[i]), float(self.linear[i]), float(self.full[i])
        budget, load = self.budget, self.load
        b_rtok, b_parent, p_rtok = self.b_rtok, self.b_parent, self.p_rtok
        best, best_t = -1, float("inf")
        for (size, c, _), heap in self.heaps.items():
            if -(-n // c) > budget:
                continue
            skipped = []
            while heap:
                key, b = heap[0]
                now = load(b)
                if key != now:  # stale: the parent took a sample since this entry was pushed
                    heapq.heapreplace(heap, (now, b))
                    continue
                if b_rtok[b] - (-n // c) <= budget and p_rtok[b_parent[b]] - (-n // size) <= budget:
                    break
                skipped.append(heapq.heappop(heap))
            if heap:
                key, b = heap[0]
                t = key + full / size + (lin + self.b_pt[b] * n) / c
                if t < best_t:
                    best, best_t = b, t
            for e in skipped:
                heapq.heappush(heap, e)
        if best >= 0:
            self.add(best, i)  # its heap entry is stale now and is re-keyed when it surfaces
        return best


def _child_pays(n: int, linear: float, full: float, parent_size: int, node: int, cost: CostModel, target: float) -> bool:
    """Should a wide parent's anchor run its sparse layers and token-wise work in a child of (at
    most) one node? Yes if that is no slower than spreading it over the whole parent (with
    inter-node exchanges at every layer), or if it stays within the per-rank target anyway (the
    parent's other ranks then take short samples free of inter-node sparse traffic). A long
    sample may fail both: a child gives its linear work to at most `node` ranks."""
    shared = full / parent_size + cost.parent_fixed(parent_size)
    a_own, b_own = cost.child_line(parent_size, parent_size)
    a_kid, b_kid = cost.child_line(node, parent_size)
    return (linear + a_kid * n) / node + b_kid <= max((linear + a_own * n) / parent_size + b_own, target - shared)


def _anchor_child(n: int, linear: float, full: float, parent_size: int, cluster: Cluster, cost: CostModel, target: float) -> int:
    """The anchor's child: the fewest ranks (from its memory floor up to a node) on which its
    parent's time, counting only the anchor, stays within the per-rank target; else a node."""
    shared = full / parent_size + cost.parent_fixed(parent_size)
    c = cluster.min_group_size(n)
    while c < cluster.gpus_per_node:
        a, b = cost.child_line(c, parent_size)
        if shared + (linear + a * n) / c + b <= target:
            break
        c *= 2
    return c


def assign_with_children(samples: Sequence[Sample], cluster: Cluster, cost: CostModel) -> tuple[tuple[Group, Kids | None], ...]:
    """Parents and their children in one pass: the parent solver's start.

    Anchor groups as in assign_parents. A parent wider than a node whose anchor fits one node gets
    a child for the anchor (sized by its memory floor and its linear share, within a node) and SP1
    children on its other ranks; the other samples then fill, longest first, whichever bin (a
    node-local group or a child) finishes earliest, priced as estimate.group_time prices it. So a
    wide parent takes the short samples its inter-node exchanges leave room for, no more.

    Returns ((Group, Kids | None), ...) in rank order; Kids lists (size, sample ids) per child."""
    samples = check_samples(samples, cluster)
    lengths, costs, anchors, groups, rest = _anchor_groups(samples, cluster, cost)
    linear = np.asarray(cost.linear_cost(lengths), dtype=np.float64)
    full = np.asarray(cost.full_cost(lengths), dtype=np.float64)
    g, node_cap = cluster.gpus_per_node, cluster.gpus_per_node * cluster.tokens_per_rank
    target = costs.sum() / cluster.world_size
    fill = _BinFill(cluster, cost, linear, full, lengths)
    parent_bins = []
    for k, (_, w) in enumerate(groups):
        kids = None
        if k < len(anchors) and w > g and lengths[anchors[k]] <= node_cap:
            i = anchors[k]
            if _child_pays(int(lengths[i]), float(linear[i]), float(full[i]), w, g, cost, target):
                c = _anchor_child(int(lengths[i]), float(linear[i]), float(full[i]), w, cluster, cost, target)
                kids = [c] + [1] * (w - c)
        bins = fill.add_parent(w, kids)
        parent_bins.append(bins)
        if k < len(anchors):
            fill.add(bins[0], int(anchors[k]))
    for i in rest:
        if fill.place(int(i)) < 0:
            raise _unplaceable(samples, i, lengths, cluster)
    out = []
    for k, (start, w) in enumerate(groups):
        ids = tuple(samples[i].id for i in fill.p_members[k])
        bins = parent_bins[k]
        kids = None if len(bins) == 1 else tuple((fill.b_size[b], tuple(samples[i].id for i in fill.b_members[b])) for b in bins)
        out.append((Group(start, w, ids), kids))
    return tuple(out)
