"""The parent assignment every mode starts from: balanced SP groups of mixed widths (FlexSP / dynamic-CP style).

Heuristic, not a MILP: (1) each sample gets a width from its memory floor and its share of the
step's cost; samples wider than one rank anchor their own group; (2) anchor groups are laid out
widest first (power-of-two widths laid out in decreasing order stay aligned) and the remaining
ranks become SP1 groups; (3) the other samples go, longest first, to the group whose per-rank
cost stays lowest, within the token budget (the shared least-loaded fill, solver.fill).

The parent solver's start (parent_solver.assign_with_children) shares steps (1) and (2) and fills
bins that know their real cost: node-local groups, and the children of parents wider than a node.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from config import PRICINGS, SettingError

from .cluster import Cluster, PlanError, Sample, StepMemo, ceil_div, ceil_pow2_array, check_samples
from .cost import CostModel
from .fill import LeastLoaded
from .layout import Group


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
    """Groups in their own layout with per-rank load and token counts; places each new sample
    where the group's per-rank load stays lowest.

    It shares the least-loaded mechanism with the joint fill (parent_solver._BinFill) but not its
    pricing: a group's load here is the sum of its samples' (cost + exchange seconds) / width,
    accumulated sample by sample, where the joint fill prices a bin with cost.shared_time +
    cost.rank_time. Pricing the assignment that way would change its plans (and every figure
    measured against them): the assignment is the design brief's, kept as it is."""

    def __init__(self, groups: list[tuple[int, int]], budget: int, comm_per_token: dict[int, float]):
        self.comm_per_token = comm_per_token  # width -> exchange seconds per token of the group
        self.start = [s for s, _ in groups]
        self.size = [w for _, w in groups]
        self.load = [0.0] * len(groups)
        self.tokens = [0] * len(groups)  # per-rank tokens, counting ceil(L / size) per sample
        self.members: list[list[int]] = [[] for _ in groups]
        self.budget = budget
        size, tokens = self.size, self.tokens

        def room(i: int) -> int:
            """The longest sample group i can still take: ceil(n / size) more tokens per rank fit its
            budget. A closure over the lists, not a method: the LeastLoaded below holds it, and a
            bound method would make a cycle that keeps the fill alive until the cyclic collector runs."""
            return size[i] * (budget - tokens[i])

        self.fill = LeastLoaded(self.load.__getitem__, room)
        for i, w in enumerate(self.size):
            self.fill.add(w, i)

    def add(self, i: int, item: int, cost: float, length: int) -> None:
        self.load[i] += (cost + self.comm_per_token[self.size[i]] * length) / self.size[i]
        self.tokens[i] += ceil_div(length, self.size[i])
        self.members[i].append(item)

    def place(self, item: int, cost: float, length: int) -> int:
        """Put the item in the group whose per-rank load stays lowest; -1 if none has room. Per
        width, the heap's top is the answer when its key is fresh and it has room (the common
        case, checked inline); otherwise LeastLoaded.least_loaded re-keys and skips."""
        best, best_key = -1, float("inf")
        tokens, budget, load, comm = self.tokens, self.budget, self.load, self.comm_per_token
        parked = self.fill.parked
        for w, heap in self.fill.heaps.items():
            need = -(-length // w)
            i = heap[0][1] if heap else -1
            p = parked[w]
            if i < 0 or heap[0][0] != load[i] or tokens[i] + need > budget or (p and -p[0][0] >= length):  # fmt: skip
                i = self.fill.least_loaded(w, length)
                if i < 0:
                    continue
            key = load[i] + (cost + comm[w] * length) / w
            if key < best_key:
                best, best_key = i, key
        if best < 0:
            return -1
        self.add(best, item, cost, length)
        heap = self.fill.heaps[self.size[best]]
        if heap[0][1] == best:  # re-keyed at once (solver.fill)
            heapq.heapreplace(heap, (load[best], best))
        return best


def exchange_cost_per_token(cluster: Cluster, cost: CostModel) -> dict[int, float]:
    """Width -> training seconds of exchanges per token the group holds, every layer running in
    the group's own layout (FlexSP prices this too)."""
    out, w = {}, 1
    while w <= cluster.world_size:
        out[w] = cost.child_line(w, w)[0]
        w *= 2
    return out


def anchor_groups(samples, cluster: Cluster, cost: CostModel, narrowings: int = 0):
    """Per-sample arrays, anchor widths, and the groups laid out widest first: (start, width)
    per anchor, in `anchors` order, then SP1 groups over the remaining ranks.

    narrowings: halve the widest anchor above its memory floor this many times (a retry when the
    fill could not place every sample: a narrower anchor leaves ranks free for the rest). None
    when no anchor can be narrowed that often.

    The parent assignment and the parent solver's joint fill both start from it on the same step:
    the answer for a checked step (a tuple of frozen Samples, cluster.check_samples) is kept until
    the next such call, read-only (its arrays unwritable, its lists tuples)."""
    key = (cluster, cost, narrowings)
    out = _ANCHORED.get(samples, key)
    if out is StepMemo.MISS:
        out = _anchor_groups(samples, cluster, cost, narrowings)
        if out is not None:
            for a in out[:2]:
                a.flags.writeable = False
            out = (*out[:2], *map(tuple, out[2:]))
        _ANCHORED.put(samples, key, out)
    return out


_ANCHORED = StepMemo()  # anchor_groups' answer for the step checked last


def _anchor_groups(samples, cluster: Cluster, cost: CostModel, narrowings: int):
    lengths = np.array([s.length for s in samples], dtype=np.int64)
    costs = np.asarray(cost.sample_cost(lengths), dtype=np.float64)
    floors = ceil_pow2_array(lengths / cluster.tokens_per_rank)  # memory floors (Cluster.min_group_size)
    widest = cost.widest_group(cluster)
    if len(floors) and floors.max() > widest:
        i = int(np.argmax(floors))
        m = cost.model
        raise PlanError(
            f"sample id={samples[i].id} of length={int(lengths[i])} needs SP{int(floors[i])} under tokens_per_rank="
            f"{cluster.tokens_per_rank}, but the model's heads ({m.n_heads} query, {m.n_kv_heads} key/value) split over "
            f"at most SP{widest} ranks; use a larger tokens_per_rank or shorter samples"
        )
    widths = anchor_widths(costs, floors, cluster.world_size, widest)
    for _ in range(narrowings):
        can = np.nonzero(widths > floors)[0]
        if len(can) == 0:
            return None
        widths[can[np.argmax(widths[can])]] //= 2
    # widest first, then costliest, then by index (stable sorts of the ascending indices)
    anchored = np.nonzero(widths > 1)[0]
    anchors = anchored[np.lexsort((-costs[anchored], -widths[anchored]))].tolist()
    groups, at = [], 0
    for i in anchors:
        groups.append((at, int(widths[i])))
        at += int(widths[i])
    groups += [(r, 1) for r in range(at, cluster.world_size)]
    others = np.nonzero(widths == 1)[0]
    rest = others[np.argsort(-costs[others], kind="stable")].tolist()  # costliest first
    return lengths, costs, anchors, groups, rest


def unplaceable(samples, i: int, lengths: np.ndarray, cluster: Cluster) -> PlanError:
    return PlanError(
        f"sample id={samples[i].id} of length={int(lengths[i])} cannot be placed: no group has room for it under "
        f"tokens_per_rank={cluster.tokens_per_rank} (a group of P ranks holds a sample of L tokens as chunks of at "
        f"most ceil(L / P) per rank), with any anchor narrowed down to its memory floor; the batch has "
        f"{int(lengths.sum())} tokens for {cluster.world_size} x {cluster.tokens_per_rank} = "
        f"{cluster.world_size * cluster.tokens_per_rank}: fill less, or raise tokens_per_rank"
    )


# anchors narrowed one halving at a time when the fill cannot place a sample, at most this often
MAX_NARROWINGS = 16


def assign_parents(samples: Sequence[Sample], cluster: Cluster, cost: CostModel, pricing: str = "compute") -> tuple[Group, ...]:
    """Parent groups covering every rank; every sample placed exactly once (or PlanError).

    pricing: what the fill balances. "compute" (the design's): full attention ~L^2 plus
    token-wise work ~L, divided over the group. "comm": also each group's own all-to-alls, as
    FlexSP's cost model does; a stronger assignment that gives wide groups fewer short samples."""
    return assign_parents_loaded(samples, cluster, cost, pricing)[0]


def assign_parents_loaded(
    samples: Sequence[Sample], cluster: Cluster, cost: CostModel, pricing: str = "compute"
) -> tuple[tuple[Group, ...], list[float]]:
    """assign_parents' groups and the per-rank load the fill gave each (what it balanced, in the
    groups' order): the planner reads the most loaded as the assigned parents likely slowest."""
    if pricing not in PRICINGS:
        raise SettingError(f"planner.assignment_pricing={pricing!r} is invalid: it must be one of {list(PRICINGS)}")
    cost = cost.for_cluster(cluster)
    samples = check_samples(samples, cluster)
    if pricing == "comm":
        comm = exchange_cost_per_token(cluster, cost)
    else:
        comm = {w: 0.0 for w in exchange_cost_per_token(cluster, cost)}
    failed = None
    for narrowings in range(MAX_NARROWINGS + 1):  # a sample that does not fit: narrow the widest anchor, retry
        start = anchor_groups(samples, cluster, cost, narrowings)
        if start is None:
            break
        lengths, costs, anchors, groups, rest = start
        fill = _GroupFill(groups, cluster.tokens_per_rank, comm)
        cost_of, length_of = costs.tolist(), lengths.tolist()  # plain numbers: the fill reads one at a time
        for gi, i in enumerate(anchors):
            fill.add(gi, i, cost_of[i], length_of[i])
        failed = next((i for i in rest if fill.place(i, cost_of[i], length_of[i]) < 0), None)
        if failed is None:
            out = tuple(Group(fill.start[k], fill.size[k], tuple(samples[i].id for i in fill.members[k])) for k in range(len(groups)))
            return out, fill.load
    raise unplaceable(samples, failed, lengths, cluster)
