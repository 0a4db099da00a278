"""Closed-form step-time estimate of a plan, used by the solvers (the simulator is the detailed
per-rank timeline; both use the same CostModel terms).

Two prices. A parent's time (parent_time, parent_times) is what the searches balance: a parent
alone, from its samples to its last layer. A whole plan's step (step_time) is what the solvers
compare whole plans by: the simulator's own sequence (solver.timeline) run over the plan's
children instead of its ranks (a Ulysses child one unit standing for its ranks, with its busiest
rank's tokens; a halo child's ranks one unit each, since they hold different chunks, exchange
different halos and form different maps), so it charges what the simulator charges: the full
layers' exchanges synchronizing each parent at every full layer, the router's barrier
synchronizing every rank at every MoE layer (a parent fastest over the whole step may still be
the slowest at one kind of layer), the gradient sync and the optimizer. It is the simulator's
step up to the order of float sums: between two synchronizations a Ulysses child's busiest rank
is its slowest (every token-wise term and every send grows with its tokens, and it sends at
least what it receives), and a test holds the two equal on every mode's plans.

A parent's units meet other parents' only at the router's barriers, so the step is each stretch
between two barriers at its slowest parent, summed (solver.timeline.stretch_ends): a parent's
stretch ends are computed the first time a priced step holds it and kept, and the plans a planner
compares on one step (most of their parents the same objects) are priced from the parents they do
not share. A test holds a step priced from kept parents to a fresh estimate's price, exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from itertools import chain, repeat
from operator import attrgetter

import numpy as np

from .cluster import Cluster, distinct
from .cost import CostModel, rank_time
from .layout import rank_tokens
from .plan import ParentPlan, StepPlan
from .reference import halo_seconds, state_load
from .simulator import redistributions
from .timeline import Groups, Phases, step_end, stretch_ends


def _gather(parents, by_start: bool = False):
    """Every parent's children in one list (each parent's by first rank when `by_start`), and per
    child, as arrays: its parent's index, sample count, size, first rank and halo flag. One pass
    over the parents; most have one child."""
    kids, owner = [], []
    for j, pp in enumerate(parents):
        ch = pp.children
        if len(ch) == 1:
            kids.append(ch[0])
            owner.append(j)
            continue
        if by_start:
            ch = sorted(ch, key=_first_rank)
        kids += ch
        owner += [j] * len(ch)
    nk = len(kids)
    counts = np.fromiter(map(len, map(_samples, kids)), dtype=np.int64, count=nk)
    sizes = np.fromiter(map(_size, kids), dtype=np.int64, count=nk)
    firsts = np.fromiter(map(_first_rank, kids), dtype=np.int64, count=nk)
    halo = np.fromiter(map(_halo, kids), dtype=bool, count=nk)
    return kids, np.array(owner, dtype=np.int64), counts, sizes, firsts, halo


_first_rank, _samples, _size, _halo = attrgetter("start"), attrgetter("samples"), attrgetter("size"), attrgetter("halo")
_group, _redistributed = attrgetter("group"), attrgetter("redistributed")


def _spans(first: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The indexes first[i], ..., first[i] + count[i] - 1 of every i, in order, and each one's i."""
    owner = np.repeat(np.arange(len(count)), count)
    return np.arange(len(owner)) - np.repeat(np.cumsum(count) - count - first, count), owner


class _Kids:
    """Child k of a plan's gathered children (a view of the known children)."""

    def __init__(self, every: list, at: np.ndarray):
        self.every, self.at = every, at

    def __getitem__(self, k: int):
        return self.every[int(self.at[k])]

    def __len__(self) -> int:
        return len(self.at)


class _Known:
    """The ParentPlans a PlanEstimate has priced steps of, each gathered once (_gather, children by
    first rank) into arrays a step's parents index: the plans a planner compares on one step share
    most of their parents (the same objects), so a step is priced from array lookups rather than a
    pass over every parent's children and samples. The parents are held, so an id stays theirs."""

    def __init__(self):
        self.index: dict[int, int] = {}  # id(ParentPlan) -> its index
        self.held: list = []
        self.kids: list = []  # every known child, each parent's in a run
        z = np.zeros(0, dtype=np.int64)
        # per parent: its group's size, redistributed, its first child's index, its child count
        self.psize, self.moved, self.kid0, self.nkid = z, np.zeros(0, dtype=bool), z, z
        # per child: sample count, size, first rank, halo, its first sample's index in rows
        self.count, self.size, self.start, self.halo, self.row0 = z, z, z, np.zeros(0, dtype=bool), z
        self.rows = z  # every known child's samples' rows, each child's in a run
        self._halo: dict[tuple[int, int], float] = {}  # (child index, id(cost model)) -> its halo exchange's seconds
        # per parent: whether its stretch ends are known, and they [kinds, parents] (columns past
        # the priced ones unused; None before the first); the step's sequence of stretches, the
        # same for every plan of the estimate's cost model
        self.priced, self.ends, self.sequence = np.zeros(0, dtype=bool), None, []
        self._priced: list = []  # the cost models priced with (held, so their ids stay theirs)

    def halo_seconds(self, k: int, length_of, priced: CostModel) -> float:
        """solver.reference.halo_seconds of known child k, computed once per cost model."""
        key = (k, id(priced))
        if key not in self._halo:
            if not any(c is priced for c in self._priced):
                self._priced.append(priced)
            self._halo[key] = halo_seconds(self.kids[k], length_of, priced)
        return self._halo[key]

    def find(self, parents: list, est: PlanEstimate) -> np.ndarray:
        """Each parent's index, gathering the ones not seen before."""
        get, n = self.index.get, len(parents)
        at = np.fromiter(map(get, map(id, parents), repeat(-1, n)), dtype=np.int64, count=n)
        if (at < 0).any():
            self._add([parents[k] for k in np.flatnonzero(at < 0).tolist()], est)
            at = np.fromiter(map(get, map(id, parents)), dtype=np.int64, count=n)
        return at

    def _add(self, new: list, est: PlanEstimate) -> None:
        kids, owner, counts, sizes, firsts, halo = _gather(new, by_start=True)
        rows = est.rows_of(chain.from_iterable(map(_samples, kids)), int(counts.sum()))
        p0, k0, r0 = len(self.held), len(self.kids), len(self.rows)
        self.index.update(zip(map(id, new), range(p0, p0 + len(new))))
        self.held += new
        self.kids += kids
        nkid = np.bincount(owner, minlength=len(new))
        cat = np.concatenate
        self.psize = cat([self.psize, np.fromiter(map(_size, map(_group, new)), dtype=np.int64, count=len(new))])
        self.moved = cat([self.moved, np.fromiter(map(_redistributed, new), dtype=bool, count=len(new))])
        self.kid0 = cat([self.kid0, k0 + np.cumsum(nkid) - nkid])
        self.nkid = cat([self.nkid, nkid])
        self.count, self.size = cat([self.count, counts]), cat([self.size, sizes])
        self.start, self.halo = cat([self.start, firsts]), cat([self.halo, halo])
        self.row0 = cat([self.row0, r0 + np.cumsum(counts) - counts])
        self.rows = cat([self.rows, rows])
        self.priced = cat([self.priced, np.zeros(len(new), dtype=bool)])

    def keep_ends(self, at: np.ndarray, sequence: list, ends: np.ndarray) -> None:
        """Keep the stretch ends [kinds, len(at)] of known parents `at`."""
        self.sequence = sequence
        if self.ends is None:
            self.ends = np.zeros((len(ends), len(self.held)))
        elif self.ends.shape[1] < len(self.held):  # room for every known parent, doubled as they come
            grown = np.zeros((len(ends), max(2 * self.ends.shape[1], len(self.held))))
            grown[:, : self.ends.shape[1]] = self.ends
            self.ends = grown
        self.ends[:, at] = ends
        self.priced[at] = True


class PlanEstimate:
    """Times of parents whose children are already chosen (ParentPlans), from per-sample terms
    computed once: the planner compares whole candidate plans with it."""

    def __init__(self, length_of: dict[int, int], cluster: Cluster, cost: CostModel):
        cost = cost.for_cluster(cluster)
        self.length_of, self.cluster, self.cost = length_of, cluster, cost
        ids = list(length_of)
        lens = np.fromiter(length_of.values(), dtype=np.float64, count=len(ids))
        # per-sample terms as arrays (parent_times) and by id (parent_time)
        # ids -> rows as an array lookup where the ids are not much sparser than the samples
        # (every planner's step: ids 0..n-1), else through the dict (rows_of)
        self._ids = id_arr = np.fromiter(ids, dtype=np.int64, count=len(ids))  # row -> id
        self._pos = None
        if len(ids) and 0 <= int(id_arr.min()) and int(id_arr.max()) < 4 * len(ids) + 1024:
            self._pos = np.full(int(id_arr.max()) + 1, -1, dtype=np.int64)
            self._pos[id_arr] = np.arange(len(ids))
        self._len = lens
        self._tokenwise = np.asarray(cost.tokenwise_cost(lens), dtype=np.float64)
        self._full = np.asarray(cost.full_cost(lens), dtype=np.float64)
        self._steps: dict[int, tuple] = {}  # id -> (parents tuple, its step_time)
        self._known = _Known()  # the parents step_time has seen, gathered once each
        self._own: dict[str, dict[int, ParentPlan]] = {}  # own_layout's plans, by reason and id(group)
        self._per_row: tuple | None = None  # per sample: full attention, sparse attention, blocks
        self.kept_layouts: tuple | None = None  # the last start a rebalance laid out, and its layouts (rebalance)
        self.tokenwise = dict(zip(ids, self._tokenwise.tolist()))
        self.full = dict(zip(ids, self._full.tolist()))

    def own_layout(self, group, reason: str) -> ParentPlan:
        """ParentPlan(group, (group,), reason), one object per Group object and reason on this
        step: the plans a planner compares (the parent solver's with and without repacking) share
        the parents they leave alone, and step_time prices a shared parent once."""
        kept = self._own.setdefault(reason, {})
        pp = kept.get(id(group))
        if pp is None:
            pp = kept[id(group)] = ParentPlan(group, (group,), reason)  # it holds the group, so the id stays its
        return pp

    @functools.cached_property
    def _row(self) -> dict[int, int]:
        """Sample id -> its row (made when first read: most steps' ids index an array, rows_of)."""
        return {s: k for k, s in enumerate(self._ids.tolist())}

    @functools.cached_property
    def longest_first(self) -> np.ndarray:
        """Each sample's place in (longest first, then by id) order, by its row (the rebalances of
        a step share it)."""
        ids, n = self._ids, len(self._ids)
        rank = np.empty(n, dtype=np.int64)
        if n and int(ids.min()) >= 0 and (float(self._len.max()) + 1) * (int(ids.max()) + 1) < 2.0**62:
            # one integer key per sample, all distinct, so one sort gives the two-key order (faster than a lexsort)
            order = np.argsort(-self._len.astype(np.int64) * (int(ids.max()) + 1) + ids)
        else:
            order = np.lexsort((ids, -self._len))
        rank[order] = np.arange(n)
        return rank

    def rows_of(self, ids: Iterable[int], count: int = -1) -> np.ndarray:
        """The rows of sample ids (in the per-sample arrays), in order; KeyError naming an id not in the step."""
        flat = np.fromiter(ids, dtype=np.int64, count=count)
        if self._pos is None:
            return np.fromiter(map(self._row.__getitem__, flat.tolist()), dtype=np.int64, count=len(flat))
        inside = (flat >= 0) & (flat < len(self._pos))
        rows = self._pos[np.where(inside, flat, 0)]
        bad = ~inside | (rows < 0)
        if bad.any():
            raise KeyError(f"sample id {int(flat[np.argmax(bad)])} is not in this step")
        return rows

    @staticmethod
    def _refuse_halo(parents) -> None:
        """It prices Ulysses children only: a parent with halo children (their exchanges are point
        to point, priced by CostModel.halo_line) is solver.reference.parent_time's, never a Ulysses guess."""
        halo = next((p for p in parents if p.halo), None)
        if halo is not None:
            raise ValueError(
                f"PlanEstimate prices Ulysses children, and the parent at rank {halo.group.start} has halo children: price it "
                f"with solver.reference.parent_time"
            )

    def parent_time(self, parent) -> float:
        """Seconds of one ParentPlan: full attention and exchanges over the parent, then its
        slowest child (an unrepacked parent's only child is the parent itself). Ulysses children
        only (a halo child: ValueError)."""
        self._refuse_halo((parent,))
        g = parent.group
        if not g.samples:
            return 0.0
        slowest = 0.0
        for c in parent.children:
            tw = sum(self.tokenwise[s] for s in c.samples)
            tok = sum(self.length_of[s] for s in c.samples)
            slowest = max(slowest, rank_time(tw, tok, c.size, self.cost.child_line(c.size, g.size)))
        return self.cost.shared_time(sum(self.full[s] for s in g.samples), g.size) + slowest

    def parent_times(self, parents) -> np.ndarray:
        """parent_time of every ParentPlan at once (the same arithmetic, summed with numpy), from
        the parents' gathered arrays (_Known: a step_time of the same parents gathers nothing again)."""
        parents = list(parents)
        if not parents:
            return np.zeros(0)
        known = self._known
        at = known.find(parents, self)
        kid_at, owner = _spans(known.kid0[at], known.nkid[at])
        if known.halo[kid_at].any():
            self._refuse_halo(parents)
        counts, sizes = known.count[kid_at], known.size[kid_at]
        nk = len(kid_at)
        row_at, of = _spans(known.row0[kid_at], counts)
        rows = known.rows[row_at]
        psize = known.psize[at]
        tw = np.bincount(of, self._tokenwise[rows], nk)
        tok = np.bincount(of, self._len[rows], nk)
        full = np.bincount(of, self._full[rows], nk)
        # each (child size, parent size)'s cost line, and each parent size's fixed seconds, once
        span = int(psize.max()) + 1
        pairs, pair_of = distinct(sizes * span + psize[owner])
        lines = np.array([self.cost.child_line(k // span, k % span) for k in pairs.tolist()]).reshape(-1, 2)[pair_of]
        kid_time = (tw + lines[:, 0] * tok) / sizes + lines[:, 1]  # cost.rank_time
        slowest = np.full(len(parents), -np.inf)
        np.maximum.at(slowest, owner, kid_time)
        pfull = np.bincount(owner, full, len(parents))
        widths, width_of = distinct(psize)
        fixed = np.array([self.cost.parent_fixed(p) for p in widths.tolist()])[width_of]
        times = pfull / psize + fixed + slowest  # cost.shared_time + the slowest child
        times[np.bincount(owner, counts, len(parents)) == 0] = 0.0  # a parent without samples
        return times

    def plan_time(self, parents) -> float:
        return float(self.parent_times(parents).max())

    def step_time(self, parents) -> float:
        """Seconds of the whole step of these ParentPlans, as the simulator charges it (the module
        docstring): any children, Ulysses or halo, folded or redistributed. A tuple priced before
        (the same object: the stages hand their plans on) is not priced again."""
        if isinstance(parents, tuple):
            known = self._steps.get(id(parents))
            if known is not None and known[0] is parents:
                return known[1]
            t = self._step_time(parents)
            self._steps[id(parents)] = (parents, t)  # held, so its id is not reused while known
            return t
        return self._step_time(parents)

    def floor_time(self, parents) -> float:
        """A lower bound on step_time of every plan with these parents' groups and samples, where
        the parents no wider than a node keep these ParentPlans and each wider one (unrepacked
        here in any way) runs its sparse layers any way: Ulysses or halo children, its own
        layout, with or without halo attention. Each wide parent is priced as one unit whose ranks
        hold its mean tokens, with its full layers as they are and its sparse layers' attention and
        exchanges free.

        Why it is a bound: in any such plan, a wide parent's ranks meet at each of its full layers'
        exchanges and at the router's barriers; between two meetings a rank's clock grows by terms
        linear in its tokens (token-wise work, the full layers' exchanges, the experts'
        all-to-alls), every other term being at least zero, so the last rank to the next meeting
        is no earlier than a rank of mean tokens paying none of the others, and a meeting's
        exchange lasts its slowest member's, no less than that rank's (the pipelined schedule too
        grows with each of its terms). So the bound's clock never passes the plan's slowest rank."""
        parents = list(parents)
        if any(pp.redistributed for pp in parents):
            raise ValueError("floor_time bounds folded plans; these parents include a redistributed one")
        return self._step_time(parents, floor=True)

    def _step_time(self, parents, floor: bool = False) -> float:
        """The step's end (timeline.step_end) from each parent's stretch ends (timeline.stretch_ends):
        a parent's are computed the first time a step holds it and kept (_Known.ends), so a plan
        that shares most of its parents with one priced before is priced from the few it does not
        (the ways choose compares, a width search's moves). floor: floor_time's units; its parents
        no wider than a node are units as a step prices them (their ends kept), only the wider
        ones' floor units are computed afresh, and not kept."""
        parents = list(parents)
        cost, world = self.cost, self.cluster.world_size
        if floor:
            node = self.cluster.gpus_per_node
            wide = [pp for pp in parents if pp.group.size > node]
            sequence, latest = self._kept_latest([pp for pp in parents if pp.group.size <= node])
            if wide:
                sequence, ends = self._stretch_ends(wide, floor=True)
                latest = np.maximum(latest, ends.max(axis=1)) if latest is not None else ends.max(axis=1)
        else:
            sequence, latest = self._kept_latest(parents)
        return step_end(sequence, latest.tolist()) + cost.grad_sync_time(world) + cost.optimizer_time(world)

    def _kept_latest(self, parents: list) -> tuple[list, np.ndarray | None]:
        """(the step's sequence of stretches, each kind's latest end over these parents), from their
        kept stretch ends, computing those of the parents never priced (None for no parents)."""
        known = self._known
        if not parents:
            return known.sequence, None
        at = known.find(parents, self)
        fresh = at[~known.priced[at]]
        if len(fresh):  # the parents never priced, each once, in index order
            mark = np.zeros(len(known.held), dtype=bool)
            mark[fresh] = True
            todo = np.flatnonzero(mark)
            sequence, ends = self._stretch_ends([known.held[k] for k in todo.tolist()])
            known.keep_ends(todo, sequence, ends)
        return known.sequence, known.ends[:, at].max(axis=1)

    def _stretch_ends(self, parents: list, floor: bool = False) -> tuple[list[tuple[int, float]], np.ndarray]:
        """timeline.stretch_ends of these parents' units: (the sequence of stretches, each kind's
        latest end per parent [kinds, parents])."""
        cost, cluster = self.cost, self.cluster
        world = cluster.world_size
        known = self._known
        at = known.find(parents, self)  # each parent's index among the known ones
        kid_at, owner = _spans(known.kid0[at], known.nkid[at])
        counts, size, starts, halo = known.count[kid_at], known.size[kid_at], known.start[kid_at], known.halo[kid_at]
        nk = len(kid_at)
        # per child: its samples' sums
        row_at, of = _spans(known.row0[kid_at], counts)
        rows = known.rows[row_at]
        psize = known.psize[at].astype(np.float64)
        lens = self._len[rows]
        if self._per_row is None:
            self._per_row = (cost.full_attn_time(self._len), cost.sparse_attn_time(self._len), cost.block_time(self._len))
        full_row, sparse_row, block_row = self._per_row
        full_attn = np.bincount(owner, np.bincount(of, full_row[rows], nk), len(parents)) / psize
        blocks = np.bincount(of, block_row[rows], nk) / np.where(halo, size, 1)
        sparse_attn = np.bincount(of, sparse_row[rows], nk) / size + blocks
        kids = _Kids(known.kids, kid_at)  # the Group of child k, for the few that need one
        # units: a Ulysses child is one, standing for its ranks; a halo child's ranks one each, and
        # so are a redistributing parent's children's: their full layers hold the parent's layout,
        # whose busiest rank need not be the child layout's, and nothing synchronizes the ranks
        # between a full layer's last token-wise work and the next layer's first
        halo_split = halo & (size > 1)
        split = (halo | known.moved[at][owner]) & (size > 1)
        per_child = np.where(split, size, 1)
        unit_of = np.repeat(np.arange(nk), per_child)  # the child of each unit
        nu = len(unit_of)
        offset = np.arange(nu) - np.repeat(np.cumsum(per_child) - per_child, per_child)
        first = starts[unit_of] + offset
        order = np.argsort(first, kind="stable")

        def busiest(per_rank: np.ndarray) -> np.ndarray:
            """Per unit, the most of a per-rank figure over the ranks it stands for (units tile the ranks)."""
            out = np.empty(nu)
            out[order] = np.maximum.reduceat(per_rank, first[order])
            return out

        # a unit's tokens are its busiest rank's: every token-wise term and every send grows with
        # them, so that rank is the unit's slowest between any two synchronizations
        tok_s = busiest(rank_tokens(kids, self.length_of, world, lens, (counts, size, starts)))
        moved = known.moved[at][owner][unit_of]
        tok_f = tok_s
        if moved.any():  # a redistributing parent's full layers hold the parent's own layout
            tok_f = np.where(moved, busiest(rank_tokens([pp.group for pp in parents], self.length_of, world)), tok_s)
        unit_sparse, unit_full = sparse_attn[unit_of], full_attn[owner][unit_of]
        lat, lat_s = cost.hw.attention_sample_latency, cost.sparse_sample_latency
        if lat:  # an attention call's cost per sample, as the simulator's _Layout prices it
            unit_full = unit_full + lat * np.bincount(owner, counts, len(parents))[owner][unit_of]
        if lat_s:  # the S layers' calls, as their kind prices them
            calls = counts[unit_of].astype(np.float64)
            if halo_split.any():  # a halo child's ranks: the samples they hold a piece of
                pieces = rank_tokens(kids, self.length_of, world, lens, (counts, size, starts), pieces=True)
                calls = np.where(halo_split[unit_of], pieces[first], calls)
            unit_sparse = unit_sparse + lat_s * calls
        free = None  # floor_time's units: a wide parent at its mean tokens, its sparse layers free
        if floor:
            free = (psize > cluster.gpus_per_node)[owner][unit_of]
            mean = (np.bincount(owner, np.bincount(of, lens, nk), len(parents)) / psize)[owner][unit_of]
            tok_s = tok_f = np.where(free, mean, tok_s)
        zero = np.zeros(nu)

        def ulysses(priced: CostModel, tok: np.ndarray, sizes: tuple[list, np.ndarray], layer_type: str, entry: bool):
            """(intra, inter) seconds of one all-to-all for a rank of each unit holding `tok` rows
            in an aligned group of its size (`sizes`: the distinct sizes, and each unit's among
            them; its peers on and off its node follow from the size)."""
            table = np.zeros((4, len(sizes[0])))
            for k, n in enumerate(sizes[0]):
                rb = priced.entry_row_bytes(n, layer_type) if entry else priced.exit_row_bytes(layer_type)
                at0, at1 = priced.exchange_time(0.0, 0, n, 0, rb), priced.exchange_time(1.0, 0, n, 0, rb)
                table[:, k] = (at1[0] - at0[0], at0[0], at1[1] - at0[1], at0[1])
            lines = table[:, sizes[1]]
            return lines[0] * tok + lines[1], lines[2] * tok + lines[3]

        def sizes_of(sizes: np.ndarray) -> tuple[list, np.ndarray]:
            values, of = distinct(sizes)
            return values.tolist(), of

        psizes, csizes = sizes_of(psize.astype(np.int64)[owner][unit_of]), sizes_of(size[unit_of])

        def exchanges(priced: CostModel):
            """(full entry, full exit, sparse entry, sparse exit), each (intra, inter) per unit."""
            f_in, f_out = ulysses(priced, tok_f, psizes, "F", True), ulysses(priced, tok_f, psizes, "F", False)
            s_in, s_out = ulysses(priced, tok_s, csizes, "S", True), ulysses(priced, tok_s, csizes, "S", False)
            for k in np.nonzero(halo_split)[0].tolist():  # a halo child: keys and values (and states) point to point, no exit
                its = np.nonzero(unit_of == k)[0]
                s_in[0][its], s_in[1][its] = known.halo_seconds(int(kid_at[k]), self.length_of, priced), 0.0
                s_out[0][its] = s_out[1][its] = 0.0
            if free is not None:
                s_in, s_out = [tuple(np.where(free, 0.0, y) for y in x) for x in (s_in, s_out)]
            return [(*x, zero, zero) for x in (f_in, f_out, s_in, s_out)]

        f_in, f_out, s_in, s_out = exchanges(cost)
        if cost.state_bytes():  # the maps each rank's chunks form (none where the kind passes no state: the loop skipped)
            for k in np.nonzero(halo_split)[0].tolist():
                unit_sparse[unit_of == k] += state_load(kids[k], self.length_of, cost)[1]
        if free is not None:
            unit_sparse = np.where(free, 0.0, unit_sparse)
        redist = None
        if moved.any():
            redist = tuple((busiest(x[0] + x[1]), zero, zero, zero) for x in self._redistributions(parents))  # a rank's whole call
        units_per_parent = np.bincount(owner[unit_of], minlength=len(parents))
        held = units_per_parent > 0
        phases = Phases(
            ranks=world,
            parent=Groups((np.cumsum(units_per_parent) - units_per_parent)[held], units_per_parent[held]),
            child=Groups(np.cumsum(per_child) - per_child, per_child),
            tokens={"S": tok_s, "F": tok_f},
            full_attn=unit_full,
            sparse_attn=unit_sparse,
            full_x=(f_in, f_out),
            sparse_x=(s_in, s_out),
            redist=redist,
        )
        if cost.costs.overlap_blocks > 1:  # one head block's exchanges (CostModel.head_block)
            fb_in, fb_out, sb_in, sb_out = exchanges(cost.head_block())
            phases.full_xb, phases.sparse_xb = (fb_in, fb_out), (sb_in, sb_out)
        sequence, ends = stretch_ends(phases, cost)
        out = np.zeros((len(ends), len(parents)))  # a parent of no unit holds no rank: it ends at zero
        out[:, held] = ends
        return sequence, out

    def _redistributions(self, parents):
        """Per rank, a redistributing plan's two hidden-state all-to-alls (the simulator's)."""
        return redistributions(StepPlan(self.cluster, tuple(self.length_of.items()), tuple(parents)), self.cost)
