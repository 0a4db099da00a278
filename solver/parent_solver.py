"""The parent solver (repack+solver): parents and their children chosen together.

Three stages, each never slower than the last:
1. assign_with_children: the assignment's anchor groups (assignment.anchor_groups), then one
   longest-first fill into bins that know their real cost: node-local groups, and the children of
   parents wider than a node (an anchor's child sized by the anchor rules below);
2. rebalance: moves and swaps between parents (solver.rebalance), then polish_children inside
   each wide parent; the slowest parents also get a child solve from scratch;
3. the result is kept only if its step (PlanEstimate.step_time, the step the simulator charges)
   is no slower than the repack plan of the assigned parents', so the planner never returns a
   plan estimated slower than its input.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from .assignment import anchor_groups, unplaceable
from .children import polish_children, solve_children
from .cluster import Cluster, PlanError, Sample, StepMemo, check_samples
from .cost import CostModel, rank_time
from .estimate import PlanEstimate
from .fill import LeastLoaded
from .layout import Group
from .plan import DISABLED, NODE_LOCAL, Kids, ParentPlan
from .rebalance import rebalance


class _BinFill:
    """Longest-first fill into bins that know what they cost: a node-local group is one bin;
    a parent wider than a node is one bin per child (its sparse layers' layout).

    A bin's time is its parent's cost.shared_time plus its own cost.rank_time, as PlanEstimate
    prices a parent. A sample joining a parent raises every bin of that parent by its full
    attention share, so keys go stale; they only grow, which the shared least-loaded fill
    (solver.fill) relies on: one heap per shape of bin (parent size, bin size, own layout)."""

    def __init__(self, cluster: Cluster, cost: CostModel, tokenwise: np.ndarray, full: np.ndarray, lengths: np.ndarray):
        self.cost, self.budget = cost, cluster.tokens_per_rank
        # plain lists: the fill reads one item at a time (numpy scalars would cost a conversion each)
        self.tokenwise, self.full, self.lengths = np.asarray(tokenwise).tolist(), np.asarray(full).tolist(), np.asarray(lengths).tolist()
        # per parent: size, full-attention seconds, its cost.shared_time, tokens per rank
        self.parent_size, self.parent_full, self.parent_shared, self.parent_rank_tokens = [], [], [], []
        self.parent_fixed = []  # cost.parent_fixed of each parent (shared_time = full / size + fixed)
        # per bin: its parent, size, cost line, tokenwise seconds, tokens, its cost.rank_time, tokens per rank
        self.bin_parent, self.bin_size, self.bin_line, self.bin_tokenwise, self.bin_tokens, self.bin_own = [], [], [], [], [], []
        self.bin_rank_tokens = []
        # every placement, in order: the item and its bin (members() groups them)
        self.placed_items: list[int] = []
        self.placed_bins: list[int] = []
        self.time, self.room = self._pricers()
        self.fill = LeastLoaded(self.time, self.room)
        self._entries: list[tuple] = []  # per shape: what place reads (_shapes)
        self._last = 0  # the shape of the last placement, looked at first
        self._lines: dict[tuple[int, int], tuple] = {}  # (bin size, parent size) -> (its cost line, an empty bin's rank time)
        self._orders: list[list[int]] = []

    def add_parent(self, size: int, child_sizes: Sequence[int] | None) -> list[int]:
        """A parent of `size` ranks with children of `child_sizes` (None: its own layout, one
        bin of all its ranks); returns its bins."""
        p = len(self.parent_size)
        self.parent_size.append(size)
        self.parent_full.append(0.0)
        self.parent_shared.append(self.cost.shared_time(0.0, size))
        self.parent_fixed.append(self.cost.parent_fixed(size))
        self.parent_rank_tokens.append(0)
        bins = []
        own = child_sizes is None
        for c in child_sizes or (size,):
            b = len(self.bin_size)
            line = self._line(c, size)
            self.bin_parent.append(p)
            self.bin_size.append(c)
            self.bin_line.append(line[0])
            self.bin_tokenwise.append(0.0)
            self.bin_tokens.append(0)
            self.bin_own.append(line[1])
            self.bin_rank_tokens.append(0)
            bins.append(b)
            self.fill.add((size, c, own), b)
        return bins

    def add_own_parents(self, size: int, count: int) -> range:
        """`count` empty parents of `size` ranks in their own layout: add_parent(size, None) of
        each, in bulk (the SP1 groups the assignment lays out after its anchors, and each run of
        anchors of one width without children: most of a large step's parents). Returns their
        bins, one each."""
        p0, b0 = len(self.parent_size), len(self.bin_size)
        line = self._line(size, size)
        self.parent_size += [size] * count
        self.parent_full += [0.0] * count
        self.parent_shared += [self.cost.shared_time(0.0, size)] * count
        self.parent_fixed += [self.cost.parent_fixed(size)] * count
        self.parent_rank_tokens += [0] * count
        self.bin_parent += range(p0, p0 + count)
        self.bin_size += [size] * count
        self.bin_line += [line[0]] * count
        self.bin_tokenwise += [0.0] * count
        self.bin_tokens += [0] * count
        self.bin_own += [line[1]] * count
        self.bin_rank_tokens += [0] * count
        bins = range(b0, b0 + count)
        self.fill.add_many((size, size, True), bins)
        return bins

    def _line(self, c: int, size: int) -> tuple:
        """A bin of `c` ranks in a parent of `size`: (its cost line, an empty bin's rank time)."""
        line = self._lines.get((c, size))
        if line is None:
            line = self._lines[(c, size)] = (self.cost.child_line(c, size), rank_time(0.0, 0, c, self.cost.child_line(c, size)))
        return line

    def _pricers(self):
        """(time, room) of a bin, as closures over the fill's lists rather than methods: the
        LeastLoaded the fill holds calls them, and a bound method would make a reference cycle
        (fill -> LeastLoaded -> method -> fill) that keeps every list and heap of the fill alive
        until the cyclic collector runs. The lists are only ever changed in place."""
        budget, bin_parent, bin_size, bin_rank_tokens, bin_own = (
            self.budget,
            self.bin_parent,
            self.bin_size,
            self.bin_rank_tokens,
            self.bin_own,
        )
        parent_size, parent_rank_tokens, parent_shared = self.parent_size, self.parent_rank_tokens, self.parent_shared

        def time(b: int) -> float:
            """Bin b's time: its parent's shared time plus its own rank time (both kept up to date by add)."""
            return parent_shared[bin_parent[b]] + bin_own[b]

        def room(b: int) -> int:
            """The longest sample bin b can still take: its own ranks' budget and its parent's."""
            p = bin_parent[b]
            return min(bin_size[b] * (budget - bin_rank_tokens[b]), parent_size[p] * (budget - parent_rank_tokens[p]))

        return time, room

    def add(self, b: int, i: int) -> None:
        p, n = self.bin_parent[b], self.lengths[i]
        size, c = self.parent_size[p], self.bin_size[b]
        full = self.parent_full[p] = self.parent_full[p] + self.full[i]
        self.parent_shared[p] = full / size + self.parent_fixed[p]  # cost.shared_time, inlined
        self.parent_rank_tokens[p] += -(-n // size)
        tokenwise = self.bin_tokenwise[b] = self.bin_tokenwise[b] + self.tokenwise[i]
        tokens = self.bin_tokens[b] = self.bin_tokens[b] + n
        a, fixed = self.bin_line[b]
        self.bin_own[b] = (tokenwise + a * tokens) / c + fixed  # cost.rank_time, inlined
        self.bin_rank_tokens[b] += -(-n // c)
        self.placed_items.append(i)
        self.placed_bins.append(b)

    def members(self, names: np.ndarray, of_bins: bool = False) -> list[tuple]:
        """The items of each parent (of each bin where `of_bins`), in the order they were placed,
        each item given as names[item] (a sample's id): grouped at once rather than kept per
        parent while filling (a large step has thousands of parents)."""
        bins = np.array(self.placed_bins, dtype=np.int64)
        key = bins if of_bins else np.array(self.bin_parent, dtype=np.int64)[bins]
        order = np.argsort(key, kind="stable")
        flat = names[np.array(self.placed_items, dtype=np.int64)[order]].tolist()
        ends = np.cumsum(np.bincount(key, minlength=len(self.bin_size) if of_bins else len(self.parent_size))).tolist()
        return [tuple(flat[a:b]) for a, b in zip([0, *ends[:-1]], ends)]

    def _shapes(self) -> tuple[list[tuple], list[list[tuple]]]:
        """Per shape of bin, in the order the shapes were added: (shape, open heap, parked heap,
        parent size, bin size, the cost line's slope); and per shape, what place_all looks at
        after that shape won: every shape as (its index, open heap, parked heap, parent size, bin
        size, slope, whether its bins are their parents' own layouts), the winner first, then the
        rest in order. Rebuilt when a parent adds a shape."""
        if len(self._entries) != len(self.fill.heaps):
            self._entries = [
                (shape, heap, self.fill.parked[shape], shape[0], shape[1], self.cost.child_line(shape[1], shape[0])[0])
                for shape, heap in self.fill.heaps.items()
            ]
            k = len(self._entries)
            self._orders = [
                [(j, *self._entries[j][1:], self._entries[j][0][2]) for j in (last, *(j for j in range(k) if j != last))]
                for last in range(k)
            ]
        return self._entries, self._orders

    def place(self, i: int) -> int:
        """Put sample i where the bin it joins finishes earliest; -1 if no bin has room."""
        return self.place_all((i,))[1]

    def place_all(self, items) -> tuple[int, int]:
        """Place `items` in order, each where the bin it joins finishes earliest (ties: the shape
        added first, then the lowest bin, solver.fill). Returns (the first item no bin has room
        for, or -1; the last bin chosen, or -1); it stops at an item that does not fit.

        Per shape of bin, the heap's top is the answer when its key is fresh and it has room (the
        common case, checked inline); otherwise LeastLoaded.least_loaded re-keys and skips.

        Most shapes cannot win, and a bound says so without looking at their bins: an open heap's
        top key is at most every open bin's time (keys only lag loads that grew), so no bin of a
        shape finishes before top key + the sample's own increment (its full-attention share on
        the parent, its tokenwise work and tokens on the bin), unless a parked bin may fit it (then
        the full query runs). The shape that won the last sample is looked at first, which makes
        the bound bite (at 4,096 ranks and fill 0.95, one shape in ten past the first is looked
        at); a shape is skipped only when its bound exceeds the best time so far by more than
        rounding (PRUNE_MARGIN), so the answer is the one a look at every shape gives."""
        budget, bin_rank_tokens, bin_parent, parent_rank_tokens = (
            self.budget,
            self.bin_rank_tokens,
            self.bin_parent,
            self.parent_rank_tokens,
        )
        parent_full, parent_fixed, parent_shared, bin_tokenwise, bin_tokens, bin_line, bin_own = (
            self.parent_full,
            self.parent_fixed,
            self.parent_shared,
            self.bin_tokenwise,
            self.bin_tokens,
            self.bin_line,
            self.bin_own,
        )
        lengths, tokenwise_of, fulls, least_loaded = self.lengths, self.tokenwise, self.full, self.fill.least_loaded
        parent_size, bin_size, chosen = self.parent_size, self.bin_size, self.placed_bins
        entries, orders = self._shapes()
        last, best = self._last if self._last < len(entries) else 0, -1
        items = items if isinstance(items, list) else list(items)
        done = len(chosen)
        heapreplace = heapq.heapreplace
        for i in items:
            n, tw, full = lengths[i], tokenwise_of[i], fulls[i]
            best, best_t, best_k, bound = -1, INF, -1, INF
            for k, heap, held, size, c, slope, own in orders[last]:
                if heap:
                    if heap[0][0] + full / size + (tw + slope * n) / c > bound and (not held or -held[0][0] < n):
                        continue  # no bin of the shape can beat the best so far, and no parked one may fit
                elif not held or -held[0][0] < n:
                    continue  # nothing open, and no parked bin may fit
                need = -(-n // c)
                if need > budget:
                    continue
                b = heap[0][1] if heap else -1
                p = bin_parent[b]
                if (
                    b < 0
                    or (held and -held[0][0] >= n)
                    or heap[0][0] != parent_shared[p] + bin_own[b]
                    or bin_rank_tokens[b] + need > budget
                    or (not own and parent_rank_tokens[p] + -(-n // size) > budget)  # an own layout's bin is its parent
                ):
                    b = least_loaded(entries[k][0], n)
                    if b < 0:
                        continue
                    p = bin_parent[b]
                # the bin's time with the sample: cost.shared_time + cost.rank_time, inlined (the fill's innermost loop)
                a, fixed = bin_line[b]
                t = ((parent_full[p] + full) / size + parent_fixed[p]) + ((bin_tokenwise[b] + tw + a * (bin_tokens[b] + n)) / c + fixed)
                if t < best_t or (t == best_t and k < best_k):
                    best, best_t, best_k, bound, best_need, best_own = b, t, k, t * PRUNE_MARGIN, need, own
            if best < 0:
                self._last = last
                self.placed_items += items[: len(chosen) - done]
                return i, -1
            last = best_k
            # self.add(best, i), inlined
            p, c = bin_parent[best], bin_size[best]
            size = parent_size[p]
            pf = parent_full[p] = parent_full[p] + full
            parent_shared[p] = pf / size + parent_fixed[p]  # cost.shared_time
            parent_rank_tokens[p] += best_need if best_own else -(-n // size)
            bl = bin_tokenwise[best] = bin_tokenwise[best] + tw
            bt = bin_tokens[best] = bin_tokens[best] + n
            a, fixed = bin_line[best]
            bin_own[best] = (bl + a * bt) / c + fixed  # cost.rank_time
            bin_rank_tokens[best] += best_need
            chosen.append(best)
            heap = entries[best_k][1]
            if heap[0][1] == best:  # re-keyed at once (solver.fill); its siblings' entries when they surface
                heapreplace(heap, (parent_shared[p] + bin_own[best], best))
        self._last = last
        self.placed_items += items
        return -1, best


INF = float("inf")
# a shape is skipped when its bound exceeds the best time by more than this factor: float sums
# in another order differ by a few ulps (1e-16 relative), far inside it
PRUNE_MARGIN = 1 + 1e-9


def _child_pays(n: int, tokenwise: float, full: float, parent_size: int, node: int, cost: CostModel, target: float) -> bool:
    """Should a wide parent's anchor run its sparse layers and token-wise work in a child of (at
    most) one node? Yes if that is no slower than spreading it over the whole parent (with
    inter-node exchanges at every layer), or if it stays within the per-rank target anyway (the
    parent's other ranks then take short samples free of inter-node sparse traffic). A long
    sample may fail both: a child gives its tokenwise work to at most `node` ranks."""
    in_child = rank_time(tokenwise, n, node, cost.child_line(node, parent_size))
    in_parent = rank_time(tokenwise, n, parent_size, cost.child_line(parent_size, parent_size))
    return in_child <= max(in_parent, target - cost.shared_time(full, parent_size))


def _anchor_child(n: int, tokenwise: float, full: float, parent_size: int, cluster: Cluster, cost: CostModel, target: float) -> int:
    """The anchor's child: the fewest ranks (from its memory floor up to a node) on which its
    parent's time, counting only the anchor, stays within the per-rank target; else a node."""
    shared = cost.shared_time(full, parent_size)
    c = cluster.min_group_size(n)
    while c < cluster.gpus_per_node:
        if shared + rank_time(tokenwise, n, c, cost.child_line(c, parent_size)) <= target:
            break
        c *= 2
    return c


def assign_with_children(
    samples: Sequence[Sample], cluster: Cluster, cost: CostModel, repack: bool = True
) -> tuple[tuple[Group, Kids | None], ...]:
    """Parents and their children in one pass: the parent solver's start.

    Anchor groups as in assign_parents. A parent wider than a node whose anchor fits one node gets
    a child for the anchor (sized by its memory floor and its tokenwise share, within a node) and SP1
    children on its other ranks; the other samples then fill, longest first, whichever bin (a
    node-local group or a child) finishes earliest, priced as PlanEstimate prices it. So a
    wide parent takes the short samples its inter-node exchanges leave room for, no more.

    Returns ((Group, Kids | None), ...) in rank order; Kids lists (size, sample ids) per child.
    repack=False: no parent gets children (every bin is a parent in its own layout)."""
    cost = cost.for_cluster(cluster)
    samples = check_samples(samples, cluster)
    lengths, costs, anchors, groups, rest = anchor_groups(samples, cluster, cost)
    tokenwise = np.asarray(cost.tokenwise_cost(lengths), dtype=np.float64)
    full = np.asarray(cost.full_cost(lengths), dtype=np.float64)
    g, node_cap = cluster.gpus_per_node, cluster.gpus_per_node * cluster.tokens_per_rank
    target = costs.sum() / cluster.world_size
    decisions = []  # per anchor's parent: its children's sizes, or None (its own layout)
    for k, (_, w) in enumerate(groups[: len(anchors)]):
        kids = None
        if repack and w > g and lengths[anchors[k]] <= node_cap:
            i = anchors[k]
            if _child_pays(int(lengths[i]), float(tokenwise[i]), float(full[i]), w, g, cost, target):
                c = _anchor_child(int(lengths[i]), float(tokenwise[i]), float(full[i]), w, cluster, cost, target)
                kids = (c,) + (1,) * (w - c)
        decisions.append(kids)
    # the fill depends on `repack` only through these decisions: where no parent gets children, the
    # fill with repacking is the fill without (choose plans both on the same step), so the answer
    # for a checked step is kept until the next call, as anchor_groups keeps its own
    key = (cluster, cost, tuple(decisions))
    kept = _JOINT.get(samples, key)
    if kept is not StepMemo.MISS:
        return kept
    fill = _BinFill(cluster, cost, tokenwise, full, lengths)
    anchor_bins = []  # each anchor's parent's bins (the SP1 groups after the anchors hold one bin each)
    k, n_anchors = 0, len(anchors)
    while k < n_anchors:
        w, run = groups[k][1], k + 1
        if decisions[k] is None:  # a run of anchors of one width in their own layout: their parents at once
            while run < n_anchors and decisions[run] is None and groups[run][1] == w:
                run += 1
            anchor_bins += [[b] for b in fill.add_own_parents(w, run - k)]
        else:
            anchor_bins.append(fill.add_parent(w, decisions[k]))
        for j in range(k, run):
            fill.add(anchor_bins[j][0], int(anchors[j]))
        k = run
    fill.add_own_parents(1, len(groups) - n_anchors)
    failed, _ = fill.place_all(rest)  # a list of ints, costliest first
    if failed >= 0:
        raise unplaceable(samples, failed, lengths, cluster)
    sid = np.fromiter((s.id for s in samples), dtype=np.int64, count=len(samples))
    members, bin_members = fill.members(sid), None
    out = []
    for k, bins in enumerate(anchor_bins):
        kids = None
        if len(bins) > 1:
            bin_members = bin_members or fill.members(sid, of_bins=True)
            kids = tuple((fill.bin_size[b], bin_members[b]) for b in bins)
        out.append((Group(*groups[k], members[k]), kids))
    out += [(Group(start, w, ids), None) for (start, w), ids in zip(groups[len(anchors) :], members[len(anchors) :])]
    out = tuple(out)
    _JOINT.put(samples, key, out)
    return out


_JOINT = StepMemo()  # assign_with_children's answer for the step checked last, keyed on the children decided


# the parents within this fraction of the slowest also get a child solve from scratch
RESOLVE_NEAR_SLOWEST = 0.01


def joint_parents(
    samples: Sequence[Sample], cluster: Cluster, cost: CostModel, est: PlanEstimate, repack: bool = True
) -> tuple[tuple[ParentPlan, ...], list[float] | None] | None:
    """Stages 1 and 2: parents and children filled together (assign_with_children), polished by
    moves and swaps between parents (rebalance) and inside them (polish_children); the slowest
    parents also get a child solve from scratch, the faster of the two kept. Returns the parents
    and their PlanEstimate times (None where repack=False: nothing here reads them); None when
    the joint fill cannot place the batch (the assignment's fill may still have placed it).
    repack=False: the same stages with every parent in its own layout (the attribution control)."""
    length_of = est.length_of
    try:
        start = assign_with_children(samples, cluster, cost, repack)
    except PlanError:
        return None
    if not repack:
        node = cluster.gpus_per_node
        polished = rebalance(start, length_of, cluster, cost, repack=False, est=est)
        return tuple(est.own_layout(g, NODE_LOCAL if g.size <= node else DISABLED) for g, _ in polished), None
    parents = []
    for g, kids in rebalance(start, length_of, cluster, cost, est=est):
        if g.size <= cluster.gpus_per_node:
            pp = est.own_layout(g, NODE_LOCAL)  # solve_children's answer for a node-local parent
        elif kids is None:
            pp = ParentPlan(g, *solve_children(g, length_of, cluster, cost))
        else:
            pp = ParentPlan(g, *polish_children(g, kids, length_of, cluster, cost))
        parents.append(pp)
    times = est.parent_times(parents).tolist()
    slowest = max(times)
    for j, pp in enumerate(parents):
        if pp.group.size > cluster.gpus_per_node and times[j] >= (1 - RESOLVE_NEAR_SLOWEST) * slowest:
            alt = ParentPlan(pp.group, *solve_children(pp.group, length_of, cluster, cost))
            t = est.parent_time(alt)
            if t < times[j]:
                parents[j], times[j] = alt, t
    return tuple(parents), times


def solve_parents(
    start: Sequence[ParentPlan],
    samples: Sequence[Sample],
    cluster: Cluster,
    cost: CostModel,
    repack: bool = True,
    est: PlanEstimate | None = None,
    likely: Sequence[ParentPlan] | None = None,
) -> tuple[tuple[ParentPlan, ...], list[float] | None]:
    """The parent solver: joint_parents, kept only if its step (PlanEstimate.step_time) is no
    slower than `start`'s (the repack plan: the assigned parents with solved children; without repacking, the
    baseline plan), which is returned otherwise, so the result is never estimated slower than
    its input. Returns the parents and the PlanEstimate time of each where joint_parents computed
    them, else None (the width solver starts from them, and prices them itself where None).
    `est`: the step's PlanEstimate, if the caller has one. `likely`: some of start's parents,
    those likely to end its step (the planner's _likely_slowest): a step of them alone is no
    later than start's, so where the joint plan's is no later than that, the joint plan is kept
    without pricing all of start (thousands of node-local parents on a large step)."""
    cost = cost.for_cluster(cluster)
    est = est or PlanEstimate({s.id: s.length for s in samples}, cluster, cost)
    start = tuple(start)
    joint = joint_parents(samples, cluster, cost, est, repack)
    if joint is not None and likely is not None and est.step_time(joint[0]) <= est.step_time(list(likely)):
        return joint
    if joint is None or est.step_time(joint[0]) > est.step_time(start):  # whole plans by the step the simulator charges
        return start, None
    return joint
