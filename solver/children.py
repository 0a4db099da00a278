"""Child solver (repack): node-local children for the sparse layers of a wide parent.

Each child is an aligned power-of-two rank range inside one node; every rank of a child does
1/size of its samples' token-wise and sparse-attention work, so a child's time is its load over
its size (plus its own node-local exchanges). The solver minimizes the slowest child.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import numpy as np

from .cluster import Cluster, ceil_div, ceil_pow2
from .cost import CostModel, rank_time
from .fill import LeastLoaded
from .layout import Group
from .plan import NODE_LOCAL


@dataclass
class ChildProblem:
    """A wide parent's samples with the per-child cost terms precomputed."""

    lengths: np.ndarray  # [n]
    tokenwise: np.ndarray  # [n] training seconds of child-layout work on one rank
    parent_size: int
    node_size: int
    budget: int
    lines: dict[int, tuple[float, float]]  # child size -> its cost line inside this parent (CostModel.child_line)

    def __post_init__(self):
        # plain Python lists and dicts for the solvers' inner loops (numpy scalars are slow one at a time)
        self.per_token = {c: a for c, (a, _) in self.lines.items()}  # seconds per token per rank, x tokens / c
        self.fixed = {c: b for c, (_, b) in self.lines.items()}  # fixed seconds (latency) of its exchanges
        self.tokenwise_list = [float(x) for x in self.tokenwise]
        self.len_list = [int(x) for x in self.lengths]
        self.order = sorted(range(len(self.tokenwise_list)), key=lambda i: -self.tokenwise_list[i])  # largest work first
        self._bound = None

    def child_time(self, size: int, tokenwise_sum: float, tokens: float) -> float:
        """cost.rank_time of a child of `size` ranks inside this parent."""
        return rank_time(tokenwise_sum, tokens, size, self.lines[size])

    def lower_bound(self) -> float:
        """A bound no assignment beats: the children's ranks (parent_size in all) must do every
        sample's cheapest work, and the slowest sample alone on its best child."""
        if self._bound is None:
            n = self.lengths
            work = np.full(len(n), np.inf)
            alone = np.full(len(n), np.inf)
            for c in self.lines:
                ok = -(-n // c) <= self.budget
                w = self.tokenwise + self.per_token[c] * n
                work = np.where(ok, np.minimum(work, w), work)
                alone = np.where(ok, np.minimum(alone, w / c + self.fixed[c]), alone)
            self._bound = float(max(work.sum() / self.parent_size, alone.max(initial=0.0)))
        return self._bound

    def fits(self, size: int, rank_tokens: int, length: int) -> bool:
        return rank_tokens + ceil_div(int(length), size) <= self.budget


def child_problem(lengths, parent_size: int, cluster: Cluster, cost: CostModel) -> ChildProblem:
    """The child problem of a parent of `parent_size` ranks. A child's per-token cost holds its
    own sparse-layer exchanges and its ranks' share of the parent's full-layer exchanges."""
    cost = cost.for_cluster(cluster)
    lengths = np.asarray(lengths, dtype=np.int64)
    g = cluster.gpus_per_node
    lines = {c: cost.child_line(c, parent_size) for c in (1 << k for k in range(g.bit_length()))}
    return ChildProblem(lengths, np.asarray(cost.tokenwise_cost(lengths), dtype=np.float64), parent_size, g, cluster.tokens_per_rank, lines)


@dataclass
class ChildSolution:
    sizes: list[int]  # child sizes, in rank order inside the parent
    starts: list[int]  # offsets inside the parent
    members: list[list[int]]  # sample indices per child
    makespan: float


def _evaluate(p: ChildProblem, sizes, members) -> float:
    return max(p.child_time(c, float(p.tokenwise[m].sum()), float(p.lengths[m].sum())) for c, m in zip(sizes, members))


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
    """Children sized for a per-rank `target`: every sample whose work exceeds the target anchors
    a child of its own (halved, least-growing first, until the anchors fit the parent), the other
    ranks become SP1 children, and the rest go, largest first, to the child they finish earliest
    in (the shared least-loaded fill). Polished by moves (and swaps) out of the slowest child."""
    tw_of, len_of, budget, per_token = p.tokenwise_list, p.len_list, p.budget, p.per_token
    floors = [ceil_pow2(n / budget) for n in len_of]
    want = [min(p.node_size, max(f, ceil_pow2(w / target) if target > 0 else 1)) for f, w in zip(floors, tw_of)]
    anchored = [i for i, w in enumerate(want) if w > 1]
    while sum(want[i] for i in anchored) > p.parent_size:
        can = [i for i in anchored if want[i] > floors[i]]
        if not can:
            return None
        pick = min(can, key=lambda i: tw_of[i] / (want[i] // 2))  # first of the least-growing
        want[pick] //= 2
        anchored = [i for i in anchored if want[i] > 1]
    n_free = p.parent_size - sum(want[i] for i in anchored)
    sizes = [want[i] for i in anchored] + [1] * n_free
    members = [[i] for i in anchored] + [[] for _ in range(n_free)]
    tw = [tw_of[i] for i in anchored] + [0.0] * n_free
    tok = [len_of[i] for i in anchored] + [0] * n_free
    rank_tokens = [-(-len_of[i] // want[i]) for i in anchored] + [0] * n_free
    fill = LeastLoaded(
        lambda k: tw[k] + per_token[sizes[k]] * tok[k],  # a child's time is monotone in this key
        lambda k: sizes[k] * (budget - rank_tokens[k]),  # the longest sample child k can still take
    )
    for k, c in enumerate(sizes):
        fill.add(c, k)
    is_anchor = set(anchored)
    for i in p.order:
        if i in is_anchor:
            continue
        li, ni = tw_of[i], len_of[i]
        best, best_t = -1, float("inf")
        for c in fill.shapes():
            k = fill.least_loaded(c, ni)
            if k >= 0:
                t = p.child_time(c, tw[k] + li, tok[k] + ni)
                if t < best_t:
                    best, best_t = k, t
        if best < 0:
            return None
        members[best].append(i)
        tw[best] += li
        tok[best] += ni
        rank_tokens[best] -= -ni // sizes[best]
    starts = _layout_children(sizes, p.parent_size, p.node_size)
    if starts is None:
        return None
    sol = ChildSolution(sizes, starts, members, _evaluate(p, sizes, members))
    _improve(p, sol, swaps=swaps)
    return sol


# Tuning of the child solver, chosen with experiments.solver_bench (the gap to the exact MILP and
# the planning time at 1024 ranks):
GREEDY_TARGET_SCALES = (1.0, 0.5, 2.0, 0.25)  # greedy starts: the per-rank target x these
BISECTION_STEPS, QUICK_BISECTION_STEPS = 24, 8  # halvings of the makespan interval (full, quick)
BISECTION_STOP = 5e-4  # stop bisecting once the interval is this close to the lower bound
AT_THE_BOUND = 1e-4  # a solution this close to the lower bound is optimal enough: return it
MAX_IMPROVE_ROUNDS = 200  # moves and swaps out of the slowest child per polish
MAX_MERGES = 8  # merges of the slowest child with its lightest neighbours per polish

# moves and swaps look at this many least-loaded children of each size, and at this many swap
# partners per child: trying every child and every pair is quadratic, and a lighter child of the
# same size is never a worse target (time is monotone in load), so little is lost
IMPROVE_TARGETS_PER_SIZE = 3
IMPROVE_SWAP_PARTNERS = 4


def _improve(p: ChildProblem, sol: ChildSolution, max_rounds: int = MAX_IMPROVE_ROUNDS, swaps: bool = True) -> None:
    """Moves and swaps out of the slowest child while they lower the makespan."""
    sizes, members = sol.sizes, sol.members
    tw_of, len_of, budget = p.tokenwise_list, p.len_list, p.budget
    child_time = p.child_time

    def sums(k):
        """(tokenwise seconds, tokens, tokens per rank) of child k."""
        m, c = members[k], sizes[k]
        return sum(tw_of[i] for i in m), sum(len_of[i] for i in m), sum(-(-len_of[i] // c) for i in m)

    st = [sums(k) for k in range(len(sizes))]
    times = [child_time(sizes[k], st[k][0], st[k][1]) for k in range(len(sizes))]
    for _ in range(max_rounds):
        worst = max(range(len(times)), key=times.__getitem__)
        cur = times[worst]
        best = None  # (new time of the pair, kind, moved sample, target child, sample swapped back)
        size_w = sizes[worst]
        lin_w, tok_w, rtok_w = st[worst]
        by_size: dict[int, list[int]] = {}
        for k in sorted(range(len(sizes)), key=times.__getitem__):
            if k != worst and len(by_size.setdefault(sizes[k], [])) < IMPROVE_TARGETS_PER_SIZE:
                by_size[sizes[k]].append(k)
        targets = [k for ks in by_size.values() for k in ks]
        # swap partners come from each target's members, largest first
        ranked = {k: sorted(members[k], key=lambda b: -tw_of[b]) for k in targets} if swaps else {}
        for a in members[worst]:
            lin_a, len_a = tw_of[a], len_of[a]
            t_worst_without_a = child_time(size_w, lin_w - lin_a, tok_w - len_a)
            for k in targets:
                size_k = sizes[k]
                lin_k, tok_k, rtok_k = st[k]
                if rtok_k - (-len_a // size_k) <= budget:
                    t = max(t_worst_without_a, child_time(size_k, lin_k + lin_a, tok_k + len_a))
                    if t < cur - 1e-15 and (best is None or t < best[0]):
                        best = (t, "move", a, k, None)
                if not swaps:
                    continue
                # swap partners: the few largest members of k below a (the ones that move the
                # most load back without overshooting)
                n_partners = 0
                for b in ranked[k]:
                    lin_b = tw_of[b]
                    if lin_b >= lin_a:
                        continue
                    n_partners += 1
                    if n_partners > IMPROVE_SWAP_PARTNERS:
                        break
                    len_b = len_of[b]
                    # rank tokens after the swap: ceil(n / size) leaves, the other's comes in
                    if (
                        rtok_w + (-len_a // size_w) - (-len_b // size_w) > budget
                        or rtok_k + (-len_b // size_k) - (-len_a // size_k) > budget
                    ):
                        continue
                    t = max(
                        child_time(size_w, lin_w - lin_a + lin_b, tok_w - len_a + len_b),
                        child_time(size_k, lin_k - lin_b + lin_a, tok_k - len_b + len_a),
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
            st[j] = sums(j)
            times[j] = child_time(sizes[j], st[j][0], st[j][1])
    sol.makespan = max(times)


def _pack_under(p: ChildProblem, limit: float) -> ChildSolution | None:
    """Best-fit decreasing with variable-size children: can every child finish within `limit`
    using at most parent_size ranks? A child of size c holds what keeps its time <= limit.

    A child's time is monotone in its load key (tokenwise + per-token x tokens), so per size the
    best fit is the open child with the largest key that still meets the limit: a bisection in
    that size's sorted keys, then a walk down past children whose token budget is full."""
    sizes, members, tw, tok, rank_tokens = [], [], [], [], []
    tw_of, len_of, budget, per_token, fixed = p.tokenwise_list, p.len_list, p.budget, p.per_token, p.fixed
    keys: dict[int, list[tuple[float, int]]] = {}  # size -> sorted (load key, child)
    used = 0
    for i in p.order:
        li, ni = tw_of[i], len_of[i]
        best, best_slack = -1, float("inf")
        for c, ks in keys.items():
            room = (limit - fixed[c]) * c - li - per_token[c] * ni  # the largest key that still fits the limit
            j = bisect.bisect_right(ks, (room, len(sizes)))
            while j > 0:
                j -= 1
                k = ks[j][1]
                if rank_tokens[k] - (-ni // c) <= budget:
                    slack = limit - p.child_time(c, tw[k] + li, tok[k] + ni)
                    if slack >= 0:  # (a rounding miss at the boundary walks on down)
                        if slack < best_slack:
                            best, best_slack = k, slack
                        break
        if best < 0:
            c = 1
            while c <= p.node_size and (not p.fits(c, 0, ni) or p.child_time(c, li, ni) > limit):
                c *= 2
            if c > p.node_size or used + c > p.parent_size:
                return None
            sizes.append(c)
            members.append([])
            tw.append(0.0)
            tok.append(0)
            rank_tokens.append(0)
            used += c
            best = len(sizes) - 1
        else:
            c = sizes[best]
            keys[c].remove((tw[best] + per_token[c] * tok[best], best))
        members[best].append(i)
        tw[best] += li
        tok[best] += ni
        rank_tokens[best] -= -ni // c
        bisect.insort(keys.setdefault(c, []), (tw[best] + per_token[c] * tok[best], best))
    sizes += [1] * (p.parent_size - used)
    members += [[] for _ in range(p.parent_size - used)]
    starts = _layout_children(sizes, p.parent_size, p.node_size)
    if starts is None:
        return None
    return ChildSolution(sizes, starts, members, _evaluate(p, sizes, members))


def _bisect_pack(p: ChildProblem, upper: float, iters: int) -> ChildSolution | None:
    lo = p.lower_bound()
    hi, best = upper, None
    for _ in range(iters):
        if hi <= lo * (1 + BISECTION_STOP):
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
    times = [p.child_time(c, float(p.tokenwise[m].sum()), float(p.lengths[m].sum())) for c, m in zip(sizes, members)]
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
    t = p.child_time(2 * c, float(p.tokenwise[merged].sum()), float(p.lengths[merged].sum()))
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


def _polish(p: ChildProblem, sol: ChildSolution, swaps: bool, max_merges: int = MAX_MERGES) -> None:
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
    with best-fit-decreasing packing; the winner is polished by moves and swaps. Stops as soon
    as a solution is within 0.01% of the lower bound.

    quick: one start, fewer bisection steps and no swaps, for the parent solver's trial
    evaluations. Instances with many samples per rank (more than two) also take one start:
    their granularity is fine, so the bisection is what closes the gap."""
    total = float(p.tokenwise.sum())
    bound = p.lower_bound()
    best = None
    few = len(p.tokenwise_list) <= 2 * p.parent_size
    for scale in GREEDY_TARGET_SCALES if few and not quick else GREEDY_TARGET_SCALES[:1]:
        sol = _greedy(p, scale * total / p.parent_size, swaps=not quick)
        if sol is not None:
            _polish(p, sol, swaps=not quick)
        if sol is not None and (best is None or sol.makespan < best.makespan):
            best = sol
            if best.makespan <= bound * (1 + AT_THE_BOUND):
                return best
    upper = best.makespan if best is not None else max(p.child_time(p.node_size, total, float(p.lengths.sum())), total)
    packed = _bisect_pack(p, upper, QUICK_BISECTION_STEPS if quick else BISECTION_STEPS)
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


def _choose(
    parent: Group, ids: list[int], lengths: np.ndarray, sol: ChildSolution | None, cost: CostModel
) -> tuple[tuple[Group, ...], str]:
    """The children of `sol` (ids and lengths in its index order), or the parent's own layout
    with the reason when there is no solution or it is not faster."""
    if sol is None:
        return (parent,), "no node-local child assignment fits the token budget"
    own = cost.own_layout_time(lengths, parent.size)
    if sol.makespan >= own:
        return (parent,), (
            f"repacking does not pay: slowest child {sol.makespan * 1e3:.1f} ms vs "
            f"{own * 1e3:.1f} ms in the parent layout (estimated sparse + token-wise time)"
        )
    kids = [Group(parent.start + st, c, tuple(ids[i] for i in m)) for c, st, m in zip(sol.sizes, sol.starts, sol.members)]
    return tuple(sorted(kids, key=lambda c: c.start)), ""


def _sorted_members(parent: Group, length_of: dict[int, int], cluster: Cluster) -> tuple[list[int], np.ndarray, str]:
    """The parent's ids longest first (ties by id) with their lengths, or the reason it keeps its
    own layout ("" when it may be repacked)."""
    g = cluster.gpus_per_node
    if parent.size <= g:
        return [], np.zeros(0, dtype=np.int64), NODE_LOCAL
    ids = sorted(parent.samples, key=lambda s: (-length_of[s], s))
    lengths = np.array([length_of[s] for s in ids], dtype=np.int64)
    node_cap = g * cluster.tokens_per_rank
    if len(lengths) and lengths[0] > node_cap:
        return (
            ids,
            lengths,
            (
                f"sample id={ids[0]} of length={int(lengths[0])} exceeds one node's capacity "
                f"({g} ranks x {cluster.tokens_per_rank} = {node_cap} tokens)"
            ),
        )
    return ids, lengths, ""


def solve_children(parent: Group, length_of: dict[int, int], cluster: Cluster, cost: CostModel) -> tuple[tuple[Group, ...], str]:
    """Children for `parent`, or ((parent,), reason) when it keeps its own layout."""
    if parent.size <= cluster.gpus_per_node:  # most parents: nothing to solve
        return (parent,), NODE_LOCAL
    cost = cost.for_cluster(cluster)
    ids, lengths, reason = _sorted_members(parent, length_of, cluster)
    if reason:
        return (parent,), reason
    # no children beat the slowest of them at the child problem's lower bound: where that bound is
    # no faster than the parent's own layout, the solve could only confirm the own layout
    bound, own = child_problem(lengths, parent.size, cluster, cost).lower_bound(), cost.own_layout_time(lengths, parent.size)
    if bound >= own:
        return (parent,), (
            f"repacking does not pay: any children take at least {bound * 1e3:.1f} ms vs "
            f"{own * 1e3:.1f} ms in the parent layout (estimated sparse + token-wise time)"
        )
    sol = solve_sorted(tuple(int(n) for n in lengths), parent.size, cluster, cost)
    return _choose(parent, ids, lengths, sol, cost)


def polish_children(
    parent: Group, kids: tuple[tuple[int, tuple[int, ...]], ...], length_of: dict[int, int], cluster: Cluster, cost: CostModel
) -> tuple[tuple[Group, ...], str]:
    """Children for `parent` starting from a given assignment ((size, sample ids) per child, as
    the parent solver leaves them): laid out in the parent, polished by moves, swaps and merges
    (never slower than given), or the parent's own layout when that is faster."""
    cost = cost.for_cluster(cluster)
    ids, lengths, reason = _sorted_members(parent, length_of, cluster)
    if reason:
        return (parent,), reason
    index = {s: i for i, s in enumerate(ids)}
    sizes = [c for c, _ in kids]
    members = [[index[s] for s in m] for _, m in kids]
    if sorted(i for m in members for i in m) != list(range(len(ids))) or sum(sizes) != parent.size:
        raise ValueError(f"children {kids} do not hold exactly the samples and ranks of {parent}")
    starts = _layout_children(sizes, parent.size, cluster.gpus_per_node)
    if starts is None:
        raise ValueError(f"child sizes {sizes} do not fit the nodes of {parent}")
    p = child_problem(lengths, parent.size, cluster, cost)
    sol = ChildSolution(sizes, starts, members, _evaluate(p, sizes, members))
    _polish(p, sol, swaps=True)
    return _choose(parent, ids, lengths, sol, cost)
