"""Parent solver, second stage: move or swap samples between parents so children can balance.

The parent solver starts it from the joint fill (parent_solver.assign_with_children), whose children come
along; `rebalance_parents` starts it from bare parents and solves their children first.
Group shapes stay fixed; only membership changes. Trial moves are priced incrementally: a wide
parent keeps its current children, a sample leaving it leaves its child and a sample joining it
joins the child where it finishes earliest (an upper bound of what re-solving the children gives).
A move is taken only if the slowest group gets faster and the group receiving the sample stays
below the old slowest time, so the step estimate (the max over groups) never rises.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

from .children import ChildProblem, child_problem, solve_sorted
from .cluster import Cluster, ceil_div, distinct
from .cost import CostModel, rank_time
from .estimate import PlanEstimate
from .layout import Group
from .plan import Kids


class _Kid:
    """A child: size, members and the sums its time needs."""

    __slots__ = ("size", "members", "tokenwise", "tokens", "rank_tokens")

    def __init__(self, size, members, tokenwise, tokens, rank_tokens):
        self.size, self.members, self.tokenwise, self.tokens, self.rank_tokens = size, members, tokenwise, tokens, rank_tokens


class _Membership:
    """Members of a parent with their sums, and its children (None: the parent's own layout)."""

    __slots__ = ("ids", "tokens", "tokenwise", "full", "rank_tokens", "kids")

    def __init__(self, ids, tokens, tokenwise, full, rank_tokens, kids):
        self.ids, self.tokens, self.tokenwise, self.full, self.rank_tokens, self.kids = ids, tokens, tokenwise, full, rank_tokens, kids


class _GroupState:
    """One parent: its current configuration and estimated time, with O(children) trial moves."""

    def __init__(self, group: Group, ids: list[int], prices: _StepPrices, kids: Kids | None = None, config: _Membership | None = None):
        """`config`: the parent's members, sorted, with their sums (_StepPrices.own_layouts), for a
        parent that keeps its own layout."""
        self.group, self.prices = group, prices
        self.size = group.size
        self.wide = prices.repack and group.size > prices.cluster.gpus_per_node  # may have children
        self.children_problem = prices.children_problem(group.size)  # prices a child inside this parent
        self.own_line = prices.cost.child_line(group.size, group.size)
        if config is not None and not self.wide:
            self.config = config
            self.time = self.price(config)
        elif kids is not None and self.wide:  # a start that comes with its children (the joint fill)
            self.config = self._config(ids, kids)
            self.time = self.price(self.config)
        else:
            self.set(ids)

    def _config(self, ids, kids_members) -> _Membership:
        c, size = self.prices, self.size
        kids = None
        if kids_members is not None:
            kids = [_Kid(kid_size, list(m), *c.sums(m, kid_size)[1:]) for kid_size, m in kids_members]
        full, tokenwise, tokens, rank_tokens = c.sums(ids, size)
        return _Membership(list(ids), tokens, tokenwise, full, rank_tokens, kids)

    def set(self, ids: list[int], hint: _Membership | None = None) -> None:
        """New members. A trial move's configuration (`hint`) is taken as it is: its children are
        a valid assignment and its price an upper bound; the planner polishes the children it
        returns (children.polish_children). Without a hint the children are solved (quick)."""
        if hint is not None:
            self.config, self.time = hint, self.price(hint)
            return
        kids = None
        length_of = self.prices.length_of
        ids = sorted(ids, key=lambda s: (-length_of[s], s))  # longest first, then by id
        lens = tuple(map(self.prices.length_of.__getitem__, ids))
        if self.wide and ids and lens[0] <= self.prices.node_cap:
            sol = solve_sorted(lens, self.size, self.prices.cluster, self.prices.cost, True)
            if sol is not None:
                kids = [(c, [ids[i] for i in m]) for c, m in zip(sol.sizes, sol.members)]
        self.config = self._config(ids, kids)
        self.time = self.price(self.config)

    def price(self, cf: _Membership) -> float:
        """The parent's time in this configuration, as PlanEstimate prices it (from cached sums):
        the shared part plus the slowest child, or the own layout where that is faster (as
        children.solve_children decides)."""
        if not cf.ids:
            return 0.0
        shared = self.prices.cost.shared_time(cf.full, self.size)
        own = rank_time(cf.tokenwise, cf.tokens, self.size, self.own_line)
        if cf.kids is not None:
            return shared + min(own, max(self.children_problem.child_time(k.size, k.tokenwise, k.tokens) for k in cf.kids))
        return shared + own

    def removing(self, a: int, cf: _Membership | None = None) -> _Membership:
        """The configuration without sample `a` (it leaves its child)."""
        cf = cf or self.config
        c = self.prices
        n, tw = c.length_of[a], c.tokenwise[a]
        kids = None
        if cf.kids is not None:
            kids = [
                k
                if a not in k.members
                else _Kid(k.size, [s for s in k.members if s != a], k.tokenwise - tw, k.tokens - n, k.rank_tokens - ceil_div(n, k.size))
                for k in cf.kids
            ]
        return _Membership(
            [s for s in cf.ids if s != a],
            cf.tokens - n,
            cf.tokenwise - tw,
            cf.full - c.full[a],
            cf.rank_tokens - ceil_div(n, self.size),
            kids,
        )

    def adding(self, a: int, cf: _Membership | None = None) -> _Membership | None:
        """The configuration with sample `a`; None if it does not fit the token budget. It joins
        the child where it finishes earliest."""
        cf = cf or self.config
        c = self.prices
        budget, n, tw = c.cluster.tokens_per_rank, c.length_of[a], c.tokenwise[a]
        if cf.rank_tokens + ceil_div(n, self.size) > budget:
            return None
        kids = None
        if cf.kids is not None and n <= c.node_cap:
            best, best_t = -1, float("inf")
            for i, k in enumerate(cf.kids):
                if k.rank_tokens + ceil_div(n, k.size) > budget:
                    continue
                t = self.children_problem.child_time(k.size, k.tokenwise + tw, k.tokens + n)
                if t < best_t:
                    best, best_t = i, t
            if best >= 0:
                k = cf.kids[best]
                kids = list(cf.kids)
                kids[best] = _Kid(k.size, k.members + [a], k.tokenwise + tw, k.tokens + n, k.rank_tokens + ceil_div(n, k.size))
        return _Membership(
            cf.ids + [a], cf.tokens + n, cf.tokenwise + tw, cf.full + c.full[a], cf.rank_tokens + ceil_div(n, self.size), kids
        )


class _OwnLayouts:
    """Parents in their own layout (_StepPrices.own_layouts): each one's members, sorted, and their
    sums, held as arrays. A parent's _Membership is made only when a move reads it (most parents of
    a large step are never the slowest nor among the fastest), and every parent's time is priced at
    once, with the arithmetic _GroupState.price does for one, in its order (the same floats)."""

    def __init__(self, ids: list[int], starts: list[int], counts: list[int], sizes: np.ndarray, sums: np.ndarray, toks: np.ndarray):
        self.ids, self.starts, self.counts, self.sizes = ids, starts, counts, sizes
        self.full, self.tokenwise = sums
        self.tokens, self.rank_tokens = toks

    def members(self, j: int) -> list[int]:
        a = self.starts[j]
        return self.ids[a : a + self.counts[j]]

    def membership(self, j: int) -> _Membership:
        if not self.counts[j]:
            return _Membership([], 0, 0.0, 0.0, 0, None)
        return _Membership(
            self.members(j), int(self.tokens[j]), float(self.tokenwise[j]), float(self.full[j]), int(self.rank_tokens[j]), None
        )

    def times(self, cost: CostModel) -> np.ndarray:
        """_GroupState.price of every parent: cost.shared_time plus rank_time on its own line (0 when empty)."""
        widths, of = distinct(self.sizes)
        fixed = np.array([cost.parent_fixed(n) for n in widths.tolist()])[of]
        line = np.array([cost.child_line(n, n) for n in widths.tolist()]).reshape(len(widths), 2)[of]
        t = (self.full / self.sizes + fixed) + ((self.tokenwise + line[:, 0] * self.tokens) / self.sizes + line[:, 1])
        return np.where(np.asarray(self.counts) > 0, t, 0.0)


class _StepPrices:
    """Per-sample prices of one step (tokenwise and full-attention seconds: the step's PlanEstimate
    holds them), its child problems by parent size, and the samples' longest-first order: what
    every _GroupState reads."""

    def __init__(self, length_of, cluster: Cluster, cost: CostModel, repack: bool = True, est: PlanEstimate | None = None):
        self.length_of, self.cluster, self.cost, self.repack = length_of, cluster, cost, repack
        self.node_cap = cluster.gpus_per_node * cluster.tokens_per_rank
        if est is None or est.length_of is not length_of:
            est = PlanEstimate(length_of, cluster, cost)
        self.est = est
        self.tokenwise, self.full = est.tokenwise, est.full
        self._children_problems: dict[int, ChildProblem] = {}
        self._rank = est.longest_first  # each sample's place in (longest first, then by id) order, by its row

    def sample_cost(self, s: int) -> float:
        """A sample's seconds on one rank (cost.sample_cost: its tokenwise plus its full-attention seconds)."""
        return self.tokenwise[s] + self.full[s]

    def own_layouts(self, groups: Sequence[Sequence[int]], sizes: Sequence[int]) -> _OwnLayouts:
        """The configuration of parents in their own layout, each with its members sorted (longest
        first, then by id) and their sums, as _GroupState.set and sums make them, for many parents
        at once. Every parent's members are sorted in one sort; the members of parents with as
        many members stand in the columns of one array, summed row by row (each column a sum in
        its members' order, each addition the one Python's sum makes, so every float is the same),
        where one sum per parent costs a Python loop over every sample of the step."""
        est = self.est
        counts = np.fromiter(map(len, groups), dtype=np.int64, count=len(groups))
        rows = est.rows_of(chain.from_iterable(groups), int(counts.sum()))
        owner = np.repeat(np.arange(len(groups)), counts)
        # each parent's members, longest first, then by id (one distinct key per member, one sort)
        rows = rows[np.argsort(owner * len(self._rank) + self._rank[rows])]
        starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        full, tokenwise, lens = est._full, est._tokenwise, est._len.astype(np.int64)
        size_of = np.asarray(sizes, dtype=np.int64)
        sums = np.zeros((2, len(groups)))  # full and tokenwise seconds
        toks = np.zeros((2, len(groups)), dtype=np.int64)  # tokens, tokens per rank
        for m in distinct(counts)[0].tolist():
            if m == 0:
                continue
            js = np.nonzero(counts == m)[0]
            pos = rows[starts[js][None, :] + np.arange(m)[:, None]]  # [m, parents]: row r is each parent's r-th member
            f, tw = full[pos[0]].copy(), tokenwise[pos[0]].copy()
            for r in range(1, m):  # row by row: the order Python's sum adds in
                f += full[pos[r]]
                tw += tokenwise[pos[r]]
            n = lens[pos]
            sums[0, js], sums[1, js] = f, tw
            toks[0, js], toks[1, js] = n.sum(axis=0), (-(-n // size_of[js])).sum(axis=0)
        return _OwnLayouts(est._ids[rows].tolist(), starts.tolist(), counts.tolist(), size_of, sums, toks)

    def start_layouts(self, start: Sequence[tuple[Group, Kids | None]]) -> _OwnLayouts:
        """own_layouts of every parent of `start`, in its order, kept on the step's PlanEstimate
        for the next rebalance from the same start object: choose rebalances the joint fill's
        parents with and without repacking, from one start where no parent got children. Each
        parent's sums are its own (summed in its members' order), whichever parents are laid out
        with it, so a rebalance reads the same floats from layouts of more parents than it keeps."""
        kept = self.est.kept_layouts
        if kept is not None and kept[0] is start:
            return kept[1]
        layouts = self.own_layouts([g.samples for g, _ in start], [g.size for g, _ in start])
        self.est.kept_layouts = (start, layouts)  # it holds the start, so the object stays the one compared
        return layouts

    def sums(self, ids, size: int) -> tuple[float, float, int, int]:
        """Full-attention and tokenwise seconds, tokens, and tokens per rank (chunks of ceil(L / size))
        of `ids` on `size` ranks, each summed in the order of `ids`."""
        lens = list(map(self.length_of.__getitem__, ids))
        tokens = sum(lens)
        rank_tokens = tokens if size == 1 else sum(-(-n // size) for n in lens)
        return sum(map(self.full.__getitem__, ids)), sum(map(self.tokenwise.__getitem__, ids)), tokens, rank_tokens

    def children_problem(self, parent_size: int) -> ChildProblem:
        """An empty child problem of a parent of `parent_size`: its child_time prices children."""
        if parent_size not in self._children_problems:
            self._children_problems[parent_size] = child_problem([], parent_size, self.cluster, self.cost)
        return self._children_problems[parent_size]


MOVES_PER_PARENT, MOVES_BASE, MAX_MOVES = 2, 32, 160
SWAP_PARTNERS = 2


def rebalance_parents(groups: tuple[Group, ...], length_of: dict[int, int], cluster: Cluster, cost: CostModel, **kw) -> tuple[Group, ...]:
    """rebalance() of parents without children given: wide parents' children are solved first.
    The paper's solver acting on given parents; the tests use it to check that rebalancing alone
    never raises the estimate."""
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
    repack: bool = True,
    est: PlanEstimate | None = None,
) -> tuple[tuple[Group, Kids | None], ...]:
    # Tuning, chosen with experiments.solver_bench (quality flat, time bounded): each move tries
    # `n_samples` of the slowest parent's samples, spread over its sizes, against the
    # `n_targets` fastest parents, and swaps with the SWAP_PARTNERS costliest smaller samples.
    """Moves and swaps out of the slowest parent while they lower it and keep every other
    parent below it. Returns the parents with their children (None: a node-local parent, or a
    wide one whose children could not be formed), in the input order.

    Bounded, since planning must hide under a training step: at most max_moves moves (default:
    MOVES_PER_PARENT per parent plus MOVES_BASE, capped at MAX_MOVES), and it stops once the last
    `window` moves together gained less than `min_gain` of the step time. repack=False: every
    parent keeps its own layout (the parent solver without repacking, a control)."""
    prices = _StepPrices(length_of, cluster, cost.for_cluster(cluster), repack, est)
    node = cluster.gpus_per_node
    own, wide = [], []  # parents that keep their own layout, and the others
    for j, (g, _) in enumerate(start):
        (wide if repack and g.size > node else own).append(j)
    layouts = prices.start_layouts(start)  # every parent's, in start's order (the wide ones' unread here)
    states: list[_GroupState | None] = [None] * len(start)  # made when a move first reads the parent
    times = np.zeros(len(start))
    if own:
        times[own] = layouts.times(prices.cost)[own]
    for j in wide:
        g, kids = start[j]
        states[j] = _GroupState(g, list(g.samples), prices, kids)
        times[j] = states[j].time

    def state(j: int) -> _GroupState:
        s = states[j]
        if s is None:
            s = states[j] = _GroupState(start[j][0], [], prices, None, layouts.membership(j))
        return s

    max_moves = min(MOVES_PER_PARENT * len(states) + MOVES_BASE, MAX_MOVES) if max_moves is None else max_moves
    history = []  # the step time before each move
    for _ in range(max_moves):
        worst = int(np.argmax(times))
        cur = times[worst]
        history.append(cur)
        if len(history) > window and history[-window - 1] - cur < min_gain * cur:
            break
        src = state(worst)
        by_cost = sorted(src.config.ids, key=lambda s: -prices.sample_cost(s))
        # a spread of sizes: large samples move much load, small ones fine-tune
        picks = sorted(set(np.linspace(0, len(by_cost) - 1, min(n_samples, len(by_cost))).round().astype(int)))
        cands = [by_cost[i] for i in picks]
        near = np.argpartition(times, min(n_targets, len(times) - 1))[: n_targets + 1]
        targets = [int(k) for k in sorted(near, key=lambda k: (times[k], k)) if k != worst][:n_targets]
        # swap partners come from each target's members, costliest first
        ranked = {k: sorted(state(k).config.ids, key=lambda b: -prices.sample_cost(b)) for k in targets}
        best = None
        for a in cands:
            out_w = src.removing(a)
            t_worst = src.price(out_w)
            if t_worst >= cur:
                continue
            cost_a = prices.sample_cost(a)
            for k in targets:
                dst = state(k)
                moved = dst.adding(a)
                if moved is not None:
                    t = max(t_worst, dst.price(moved))
                    if t < cur * (1 - 1e-9) and (best is None or t < best[0]):
                        best = (t, k, out_w, moved)
                for b in [b for b in ranked[k] if prices.sample_cost(b) < cost_a][:SWAP_PARTNERS]:
                    into_k = dst.adding(a, dst.removing(b))
                    into_w = src.adding(b, out_w)
                    if into_k is None or into_w is None:
                        continue
                    t = max(src.price(into_w), dst.price(into_k))
                    if t < cur * (1 - 1e-9) and (best is None or t < best[0]):
                        best = (t, k, into_w, into_k)
        if best is None:
            break
        _, k, new_w, new_k = best
        src.set(new_w.ids, new_w)
        state(k).set(new_k.ids, new_k)
        times[worst], times[k] = src.time, states[k].time
    out = list(start)
    ids, firsts, counts = layouts.ids, layouts.starts, layouts.counts
    for j in own:
        g = start[j][0]
        if states[j] is None:  # never read: its own layout, its members sorted
            held = tuple(ids[firsts[j] : firsts[j] + counts[j]])
            if held != g.samples or start[j][1] is not None:
                out[j] = (Group(g.start, g.size, held), None)
    for j, s in enumerate(states):
        if s is not None:
            kids = None if s.config.kids is None else tuple((k.size, tuple(k.members)) for k in s.config.kids)
            out[j] = (Group(s.group.start, s.group.size, tuple(s.config.ids)), kids)
    return tuple(out)
