"""Baseline parent assignment: balanced SP groups of mixed widths (FlexSP / dynamic-CP style).

Heuristic, not a MILP: (1) each sample gets a width from its memory floor and its share of the
step's cost; samples wider than one rank anchor their own group; (2) anchor groups are laid out
widest first (power-of-two widths laid out in decreasing order stay aligned) and the remaining
ranks become SP1 groups; (3) the other samples go, longest first, to the group whose per-rank
cost stays lowest, within the token budget.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from .cluster import Cluster, PlanError, Sample, ceil_div, ceil_pow2, check_samples
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
    widths = np.array([min(widest, max(int(f), ceil_pow2(c / target) if target > 0 else 1)) for c, f in zip(costs, floors)])
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


def repack_widths(widths, lengths, costs, floors, cluster: Cluster, cost: CostModel, widest: int) -> np.ndarray:
    """Widen parents whose sparse layers will run in node-local children.

    With repacking, a long sample's token-wise and sparse work runs on a child of c <= node
    ranks while only its full attention spreads over the parent's P ranks, so its ranks carry
    linear / c + full / P. The parent is made wide enough for that to meet the per-rank target
    (its other ranks take short samples in SP1 children, free of inter-node traffic). Samples
    that do not fit a node, or whose linear work alone exceeds the target on a whole node, keep
    their width. Anchors are shrunk back, as in anchor_widths, if they outgrow the cluster.
    """
    g = cluster.gpus_per_node
    target = costs.sum() / cluster.world_size
    linear = np.asarray(cost.linear_cost(lengths), dtype=np.float64)
    full = np.asarray(cost.full_cost(lengths), dtype=np.float64)
    out = widths.copy()
    for i in np.nonzero(widths > 1)[0]:
        if lengths[i] > g * cluster.tokens_per_rank:
            continue
        c = max(int(floors[i]), ceil_pow2(linear[i] / target))
        if c > g:
            continue
        room = target - linear[i] / c
        want = min(widest, max(c, ceil_pow2(full[i] / room)))
        if want > g:
            out[i] = max(out[i], want)
    anchored = out > 1
    while out[anchored].sum() > cluster.world_size:
        grown = np.nonzero(anchored & (out > widths))[0]
        if not len(grown):
            break
        pick = grown[np.argmin(costs[grown] / (out[grown] // 2))]
        out[pick] //= 2
    return out


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
        self.add(best, item, cost, length)
        heapq.heappush(self.heaps[self.size[best]], (self.load[best], best))
        return best


def exchange_cost_per_token(cluster: Cluster, cost: CostModel, repack_aware: bool = False) -> dict[int, float]:
    """Width -> training seconds of exchanges per token the group holds.

    Baseline: every layer runs in the group's own layout (FlexSP prices this too). Repack-aware:
    groups wider than a node pay their own exchanges only at full-attention layers, since their
    sparse layers will run in node-local children."""
    out, w = {}, 1
    while w <= cluster.world_size:
        layers = cost.model.n_full if (repack_aware and w > cluster.gpus_per_node) else cost.model.n_layers
        out[w] = layers * cost.exchange_line(w)[0]
        w *= 2
    return out


PRICINGS = ("compute", "comm")


def assign_parents(
    samples: Sequence[Sample], cluster: Cluster, cost: CostModel, repack_aware: bool = False, pricing: str = "compute"
) -> tuple[Group, ...]:
    """Parent groups covering every rank; every sample placed exactly once (or PlanError).

    pricing: what the fill balances. "compute" (the design's baseline): full attention ~L^2 plus
    token-wise work ~L, divided over the group. "comm": also each group's own all-to-alls, as
    FlexSP's cost model does; a stronger baseline that gives wide groups fewer short samples.

    repack_aware prices wide groups as the parent solver will run them (sparse layers in
    node-local children), so they take more of the short samples."""
    samples = check_samples(samples, cluster)
    lengths = np.array([s.length for s in samples], dtype=np.int64)
    costs = np.asarray(cost.sample_cost(lengths), dtype=np.float64)
    floors = np.array([cluster.min_group_size(int(n)) for n in lengths])
    widest = _widest_group(cluster.world_size)
    widths = anchor_widths(costs, floors, cluster.world_size, widest)
    if repack_aware:
        widths = repack_widths(widths, lengths, costs, floors, cluster, cost, widest)

    anchors = sorted(np.nonzero(widths > 1)[0], key=lambda i: (-widths[i], -costs[i]))
    groups, at = [], 0
    for i in anchors:
        groups.append((at, int(widths[i])))
        at += int(widths[i])
    groups += [(r, 1) for r in range(at, cluster.world_size)]

    if pricing not in PRICINGS:
        raise PlanError(f"pricing={pricing!r}; valid: {PRICINGS}")
    if pricing == "comm" or repack_aware:
        comm = exchange_cost_per_token(cluster, cost, repack_aware)
    else:
        comm = {w: 0.0 for w in exchange_cost_per_token(cluster, cost)}
    fill = _GroupFill(groups, cluster.tokens_per_rank, comm)
    for gi, i in enumerate(anchors):
        fill.add(gi, int(i), float(costs[i]), int(lengths[i]))
        heapq.heappush(fill.heaps[fill.size[gi]], (fill.load[gi], gi))
    for i in sorted(np.nonzero(widths == 1)[0], key=lambda i: -costs[i]):
        if fill.place(int(i), float(costs[i]), int(lengths[i])) < 0:
            raise PlanError(
                f"sample id={samples[i].id} of length={int(lengths[i])} cannot be placed: no group has "
                f"{int(lengths[i])} free tokens left under tokens_per_rank={cluster.tokens_per_rank}; "
                f"the batch ({int(lengths.sum())} tokens) is too large for {cluster.world_size} ranks"
            )
    return tuple(Group(fill.start[k], fill.size[k], tuple(samples[i].id for i in fill.members[k])) for k in range(len(groups)))
