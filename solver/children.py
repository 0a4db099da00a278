"""Child solver (repack): node-local children for the sparse layers of a wide parent.

Each child is an aligned power-of-two rank range inside one node; every rank of a child does
1/size of its samples' token-wise and sparse-attention work, so a child's time is its load over
its size (plus its own node-local exchanges). The solver minimizes the slowest child.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import numpy as np

from .cluster import Cluster, ceil_div, ceil_pow2
from .cost import CostModel
from .layout import Group
from .plan import NODE_LOCAL


@dataclass
class ChildProblem:
    """A wide parent's samples with the per-child cost terms precomputed."""

    lengths: np.ndarray  # [n]
    linear: np.ndarray  # [n] training seconds of child-layout work on one rank
    parent_size: int
    node_size: int
    budget: int
    comm_per_token: dict[int, float]  # child size -> seconds per token per rank of its exchanges
    comm_fixed: dict[int, float]  # child size -> fixed seconds (latency) of its exchanges

    def child_time(self, size: int, linear_sum: float, tokens: float) -> float:
        return (linear_sum + self.comm_per_token[size] * tokens) / size + self.comm_fixed[size]

    def fits(self, size: int, rank_tokens: int, length: int) -> bool:
        return rank_tokens + ceil_div(int(length), size) <= self.budget


def child_problem(lengths, parent_size: int, cluster: Cluster, cost: CostModel) -> ChildProblem:
    """The child problem of a parent of `parent_size` ranks. A child's per-token cost holds its
    own sparse-layer exchanges and its ranks' share of the parent's full-layer exchanges."""
    lengths = np.asarray(lengths, dtype=np.int64)
    g = cluster.gpus_per_node
    parent_x = cost.model.n_full * cost.exchange_line(parent_size)[0]
    per_token, fixed = {}, {}
    for c in (1 << k for k in range(g.bit_length())):
        a, b = cost.exchange_line(c)  # (0, 0) for a child of one rank
        per_token[c] = cost.model.n_sparse * a + parent_x  # x the child's tokens / c = per-rank seconds
        fixed[c] = cost.model.n_sparse * b
    return ChildProblem(
        lengths, np.asarray(cost.linear_cost(lengths), dtype=np.float64), parent_size, g, cluster.tokens_per_rank, per_token, fixed
    )


@dataclass
class ChildSolution:
    sizes: list[int]  # child sizes, in rank order inside the parent
    starts: list[int]  # offsets inside the parent
    members: list[list[int]]  # sample indices per child
    makespan: float


def _evaluate(p: ChildProblem, sizes, members) -> float:
    return max(p.child_time(c, float(p.linear[m].sum()), float(p.lengths[m].sum())) for c, m in zip(sizes, members))


def _layout_children(sizes: list[int], parent_size: int, node_size: int) -> list[int] | None:
    """First-fit-decreasing of power-of-two sizes into nodes; returns offsets (same order as sizes)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    free = [0] * (parent_size // node_size)
    starts = [0] * len(sizes)
    for i in order:
        for n in range(len(free)):
            if free[n] + sizes[i] <= node_size:
                starts[i] = n * node_size + free[n]
                free[n] += sizes[i]
                break
        else:
            return None
    return starts


def _greedy(p: ChildProblem, target: float, swaps: bool = True) -> ChildSolution | None:
    floors = np.array([ceil_pow2(ln / p.budget) for ln in p.lengths])
    want = np.array([min(p.node_size, max(int(f), ceil_pow2(lin / target) if target > 0 else 1)) for f, lin in zip(floors, p.linear)])
    anchored = want > 1
    while want[anchored].sum() > p.parent_size:
        can = np.nonzero(anchored & (want > floors))[0]
        if not len(can):
            return None
        pick = can[np.argmin(p.linear[can] / (want[can] // 2))]
        want[pick] //= 2
        anchored = want > 1
    anchors = [int(i) for i in np.nonzero(anchored)[0]]
    sizes = [int(want[i]) for i in anchors]
    sizes += [1] * (p.parent_size - sum(sizes))
    members = [[i] for i in anchors] + [[] for _ in range(len(sizes) - len(anchors))]
    lin = [float(p.linear[i]) for i in anchors] + [0.0] * (len(sizes) - len(anchors))
    tok = [int(p.lengths[i]) for i in anchors] + [0] * (len(sizes) - len(anchors))
    rtok = [ceil_div(int(p.lengths[i]), int(want[i])) for i in anchors] + [0] * (len(sizes) - len(anchors))
    # per child size, a heap of (load key, child): the best child of a size is its least loaded
    # one that still has room, so each sample looks at one child per distinct size
    heaps: dict[int, list[tuple[float, int]]] = {}
    for k, c in enumerate(sizes):
        heaps.setdefault(c, []).append((lin[k] + p.comm_per_token[c] * tok[k], k))
    for h in heaps.values():
        heapq.heapify(h)
    for i in sorted(np.nonzero(~anchored)[0], key=lambda i: -p.linear[i]):
        li, ni = float(p.linear[i]), int(p.lengths[i])
        best, best_t = -1, float("inf")
        for c, heap in heaps.items():
            skipped = []
            while heap and not p.fits(c, rtok[heap[0][1]], ni):
                skipped.append(heapq.heappop(heap))
            if heap:
                k = heap[0][1]
                t = p.child_time(c, lin[k] + li, tok[k] + ni)
                if t < best_t:
                    best, best_t = k, t
            for e in skipped:
                heapq.heappush(heap, e)
        if best < 0:
            return None
        c = sizes[best]
        heap = heaps[c]
        heap.remove((lin[best] + p.comm_per_token[c] * tok[best], best))
        members[best].append(int(i))
        lin[best] += li
        tok[best] += ni
        rtok[best] += ceil_div(ni, c)
        heap.append((lin[best] + p.comm_per_token[c] * tok[best], best))
        heapq.heapify(heap)
    starts = _layout_children(sizes, p.parent_size, p.node_size)
    if starts is None:
        return None
    sol = ChildSolution(sizes, starts, members, _evaluate(p, sizes, members))
    _improve(p, sol, swaps=swaps)
    return sol


def _improve(p: ChildProblem, sol: ChildSolution, max_rounds: int = 200, swaps: bool = True) -> None:
    """Moves and swaps out of the slowest child while they lower the makespan."""
    sizes, members = sol.sizes, sol.members

    def stats(k):
        m = members[k]
        return (
            float(p.linear[m].sum()),
            float(p.lengths[m].sum()),
            sum(ceil_div(int(p.lengths[i]), sizes[k]) for i in m),
        )

    st = [stats(k) for k in range(len(sizes))]
    times = [p.child_time(sizes[k], st[k][0], st[k][1]) for k in range(len(sizes))]
    for _ in range(max_rounds):
        worst = int(np.argmax(times))
        cur = times[worst]
        best = None  # (new_pair_max, kind, ...)
        lw, tw, rw = st[worst]
        # targets: the few least-loaded children of each size. For a move, a lighter child of the
        # same size is never worse (time is monotone in load), so this loses little and keeps a
        # round O(members x sizes) instead of O(members x children)
        by_size: dict[int, list[int]] = {}
        for k in sorted(range(len(sizes)), key=lambda k: times[k]):
            if k != worst and len(by_size.setdefault(sizes[k], [])) < 3:
                by_size[sizes[k]].append(k)
        targets = [k for ks in by_size.values() for k in ks]
        for a in members[worst]:
            la, na = float(p.linear[a]), int(p.lengths[a])
            tw_new = p.child_time(sizes[worst], lw - la, tw - na)
            for k in targets:
                lk, tk, rk = st[k]
                if p.fits(sizes[k], rk, na):
                    t = max(tw_new, p.child_time(sizes[k], lk + la, tk + na))
                    if t < cur - 1e-15 and (best is None or t < best[0]):
                        best = (t, "move", a, k, None)
                # swap partners: the few largest members of k below a (the ones that move the
                # most load back without overshooting); trying every pair is quadratic
                partners = sorted((b for b in members[k] if p.linear[b] < la), key=lambda b: -p.linear[b])[:4] if swaps else ()
                for b in partners:
                    lb, nb = float(p.linear[b]), int(p.lengths[b])
                    if rw - ceil_div(na, sizes[worst]) + ceil_div(nb, sizes[worst]) > p.budget:
                        continue
                    if rk - ceil_div(nb, sizes[k]) + ceil_div(na, sizes[k]) > p.budget:
                        continue
                    t = max(
                        p.child_time(sizes[worst], lw - la + lb, tw - na + nb),
                        p.child_time(sizes[k], lk - lb + la, tk - nb + na),
                    )
                    if t < cur - 1e-15 and (best is None or t < best[0]):
                        best = (t, "swap", a, k, b)
        if best is None:
            break
        _, kind, a, k, b = best
        members[worst].remove(a)
        members[k].append(a)
        if kind == "swap":
            members[k].remove(b)
            members[worst].append(b)
        for j in (worst, k):
            st[j] = stats(j)
            times[j] = p.child_time(sizes[j], st[j][0], st[j][1])
    sol.makespan = max(times)


def _pack_under(p: ChildProblem, limit: float) -> ChildSolution | None:
    """Best-fit decreasing with variable-size children: can every child finish within `limit`
    using at most parent_size ranks? A child of size c holds what keeps its time <= limit."""
    sizes, members, lin, tok, rtok = [], [], [], [], []
    used = 0
    for i in sorted(range(len(p.lengths)), key=lambda i: -p.linear[i]):
        li, ni = float(p.linear[i]), int(p.lengths[i])
        best, best_slack = -1, float("inf")
        for k, c in enumerate(sizes):
            if not p.fits(c, rtok[k], ni):
                continue
            t = p.child_time(c, lin[k] + li, tok[k] + ni)
            if t <= limit and limit - t < best_slack:
                best, best_slack = k, limit - t
        if best < 0:
            c = 1
            while c <= p.node_size and (not p.fits(c, 0, ni) or p.child_time(c, li, ni) > limit):
                c *= 2
            if c > p.node_size or used + c > p.parent_size:
                return None
            sizes.append(c)
            members.append([])
            lin.append(0.0)
            tok.append(0)
            rtok.append(0)
            used += c
            best = len(sizes) - 1
        members[best].append(i)
        lin[best] += li
        tok[best] += ni
        rtok[best] += ceil_div(ni, sizes[best])
    sizes += [1] * (p.parent_size - used)
    members += [[] for _ in range(p.parent_size - used)]
    starts = _layout_children(sizes, p.parent_size, p.node_size)
    if starts is None:
        return None
    return ChildSolution(sizes, starts, members, _evaluate(p, sizes, members))


def _bisect_pack(p: ChildProblem, upper: float, iters: int) -> ChildSolution | None:
    lo = float(p.linear.sum()) / p.parent_size
    hi, best = upper, None
    for _ in range(iters):
        if hi <= lo * 1.0005:
            break
        mid = 0.5 * (lo + hi)
        sol = _pack_under(p, mid)
        if sol is None:
            lo = mid
        else:
            hi, best = sol.makespan, sol
    return best


def _merge_worst(p: ChildProblem, sol: ChildSolution) -> bool:
    """Merge the slowest child (size c) with the least-loaded children holding c ranks in all
    into one child of size 2c (time ~ the average of theirs). True if the makespan fell."""
    sizes, members = sol.sizes, sol.members
    times = [p.child_time(c, float(p.linear[m].sum()), float(p.lengths[m].sum())) for c, m in zip(sizes, members)]
    worst = int(np.argmax(times))
    c = sizes[worst]
    if 2 * c > p.node_size:
        return False
    need, partners = c, []
    for k in sorted((k for k in range(len(sizes)) if k != worst and sizes[k] <= c), key=lambda k: times[k] * sizes[k]):
        if sizes[k] <= need:
            partners.append(k)
            need -= sizes[k]
            if need == 0:
                break
    if need:
        return False
    merged = members[worst] + [i for k in partners for i in members[k]]
    if sum(ceil_div(int(p.lengths[i]), 2 * c) for i in merged) > p.budget:
        return False
    t = p.child_time(2 * c, float(p.linear[merged].sum()), float(p.lengths[merged].sum()))
    if t >= times[worst]:
        return False
    keep = [k for k in range(len(sizes)) if k != worst and k not in partners]
    new_sizes = [sizes[k] for k in keep] + [2 * c]
    new_members = [members[k] for k in keep] + [merged]
    starts = _layout_children(new_sizes, p.parent_size, p.node_size)
    if starts is None:
        return False
    sol.sizes, sol.members, sol.starts = new_sizes, new_members, starts
    sol.makespan = _evaluate(p, new_sizes, new_members)
    return True


def _polish(p: ChildProblem, sol: ChildSolution, swaps: bool, max_merges: int = 8) -> None:
    _improve(p, sol, swaps=swaps)
    for _ in range(max_merges):
        before = sol.makespan
        if not _merge_worst(p, sol):
            break
        _improve(p, sol, swaps=swaps)
        if sol.makespan >= before:
            break


def solve_child_problem(p: ChildProblem, quick: bool = False) -> ChildSolution | None:
    """Best of greedy starts (target share scaled) and a bisection over the slowest child's time
    with best-fit-decreasing packing; the winner is polished by moves and swaps.
    quick: fewer starts and no swaps, for the parent solver's many trial evaluations."""
    total = float(p.linear.sum())
    best = None
    for scale in (1.0,) if quick else (1.0, 0.5, 2.0, 0.25):
        sol = _greedy(p, scale * total / p.parent_size, swaps=not quick)
        if sol is not None:
            _polish(p, sol, swaps=not quick)
        if sol is not None and (best is None or sol.makespan < best.makespan):
            best = sol
    upper = best.makespan if best is not None else max(p.child_time(p.node_size, total, float(p.lengths.sum())), total)
    packed = _bisect_pack(p, upper, 8 if quick else 24)
    if packed is not None:
        _polish(p, packed, swaps=not quick)
        if best is None or packed.makespan < best.makespan:
            best = packed
    return best


@functools.lru_cache(maxsize=4096)
def solve_sorted(lengths: tuple[int, ...], parent_size: int, cluster: Cluster, cost: CostModel, quick: bool = False):
    """solve_child_problem for lengths sorted longest first, memoized: a planning call prices the
    same parent several times (estimates, the parent solver's check, the final plan). Callers
    must not mutate the returned solution."""
    return solve_child_problem(child_problem(np.array(lengths, dtype=np.int64), parent_size, cluster, cost), quick=quick)


def solve_children(parent: Group, length_of: dict[int, int], cluster: Cluster, cost: CostModel) -> tuple[tuple[Group, ...], str]:
    """Children for `parent`, or ((parent,), reason) when it keeps its own layout."""
    g = cluster.gpus_per_node
    if parent.size <= g:
        return (parent,), NODE_LOCAL
    ids = list(parent.samples)
    lengths = np.array([length_of[s] for s in ids], dtype=np.int64)
    node_cap = g * cluster.tokens_per_rank
    too_long = [(s, int(n)) for s, n in zip(ids, lengths) if n > node_cap]
    if too_long:
        s, n = too_long[0]
        return (parent,), (
            f"sample id={s} of length={n} exceeds one node's capacity ({g} ranks x {cluster.tokens_per_rank} = {node_cap} tokens)"
        )
    order = sorted(range(len(ids)), key=lambda i: (-int(lengths[i]), ids[i]))
    ids, lengths = [ids[i] for i in order], lengths[order]
    sol = solve_sorted(tuple(int(n) for n in lengths), parent.size, cluster, cost)
    if sol is None:
        return (parent,), "no node-local child assignment fits the token budget"
    from .estimate import own_layout_part  # estimate imports this module

    own = own_layout_part(parent, lengths, cost)
    if sol.makespan >= own:
        return (parent,), (
            f"repacking does not pay: slowest child {sol.makespan * 1e3:.1f} ms vs "
            f"{own * 1e3:.1f} ms in the parent layout (estimated sparse + token-wise time)"
        )
    kids = [Group(parent.start + st, c, tuple(ids[i] for i in m)) for c, st, m in zip(sol.sizes, sol.starts, sol.members)]
    return tuple(sorted(kids, key=lambda c: c.start)), ""
