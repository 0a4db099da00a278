"""One entry point: samples + cluster + cost model + mode -> a validated StepPlan.

The planner composes a plan from the stages of the mode's declared record (solver.modes): the
parent assignment every mode starts from (solver.assignment), each wide parent's first way to run
its sparse layers (its own layout; node-local Ulysses children from the child solver,
solver.children; halo children or its own layout with halo attention, solver.halo), the parent
solver (solver.parent_solver, solver.rebalance) and the width search (solver.width_solver), the
per-parent choice of the cheapest way (solver.halo.choose_children; the whole plan no slower than
any single way's), and whether a repacked
parent's layout change is folded into the full layers' all-to-alls or made by a redistribution
of its own (recorded per parent in the plan). It never branches on a mode's name.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from config import SettingError

from .assignment import assign_parents_loaded
from .children import solve_children
from .cluster import Cluster, PlanError, Sample, ceil_pow2, check_samples
from .cost import CostModel
from .estimate import PlanEstimate
from .halo import choose_children, own_layout_halo, solve_halo_children
from .layout import Group
from .modes import CHILDREN, HALO_CHILDREN, MODE_TABLE, OWN, OWN_HALO, Mode, mode_of
from .parent_solver import solve_parents
from .plan import DISABLED, NODE_LOCAL, ParentPlan, StepPlan
from .width_solver import solve_widths


def _parent_plans(
    groups: Sequence[Group], length_of: dict[int, int], cluster: Cluster, cost: CostModel, start: str, local: Sequence[ParentPlan]
) -> tuple[ParentPlan, ...]:
    """Each parent's first way to run its sparse layers (a Mode's `start`): a node-local parent
    keeps its own layout (`local`: each node-local group's ParentPlan, in order, one object for
    every start, so the step prices of the starts' plans share them); a wide one as `start` says."""
    parents, local = [], iter(local)
    for g in groups:
        if g.size <= cluster.gpus_per_node:
            parents.append(next(local))
        elif start == OWN:
            parents.append(ParentPlan(g, (g,), DISABLED))
        elif start == HALO_CHILDREN:
            parents.append(ParentPlan(g, *solve_halo_children(g, length_of, cluster, cost)))
        elif start == OWN_HALO:
            parents.append(own_layout_halo(g, length_of, cost))
        elif start == CHILDREN:
            parents.append(ParentPlan(g, *solve_children(g, length_of, cluster, cost)))
        else:
            raise ValueError(f"no parent stage for start={start!r}")
    return tuple(parents)


def _cheapest(parents: Sequence[ParentPlan], length_of: dict[int, int], cluster: Cluster, cost: CostModel) -> tuple[ParentPlan, ...]:
    """Each wide parent reworked to the cheapest way to run its sparse layers (solver.halo)."""
    return tuple(
        choose_children(p.group, (p.children, "") if p.repacked else ((p.group,), p.reason), length_of, cluster, cost)
        if p.group.size > cluster.gpus_per_node
        else p
        for p in parents
    )


def compose(
    mode: Mode, samples: Sequence[Sample], cluster: Cluster, cost: CostModel, assignment_pricing: str = "compute", memo: dict | None = None
) -> StepPlan:
    """The plan of `mode`'s stages, in order, for checked samples and a cost model bound to the
    cluster. `memo`: stages already run on this step by another mode (the choice runs them all)."""
    parents = _parents(mode, samples, cluster, cost, assignment_pricing, {} if memo is None else memo)
    return StepPlan(cluster, tuple((s.id, s.length) for s in samples), parents, mode.name).validate()


def _parents(
    mode: Mode, samples: Sequence[Sample], cluster: Cluster, cost: CostModel, assignment_pricing: str, memo: dict
) -> tuple[ParentPlan, ...]:
    """compose's parents, before the plan is laid out and validated."""
    if "lengths" not in memo:
        memo["lengths"] = {s.id: s.length for s in samples}
    length_of = memo["lengths"]
    if "assignment" not in memo:
        memo["assignment"], memo["loads"] = assign_parents_loaded(samples, cluster, cost, pricing=assignment_pricing)
    parents = _started(mode.start, cluster, cost, memo)
    key = (mode.start,)
    if mode.solver:
        if "estimate" not in memo:
            memo["estimate"] = PlanEstimate(length_of, cluster, cost)  # one per step, shared by the solvers
        est = memo["estimate"]
        key += ("solver", mode.repacks)
        if key not in memo:
            memo[key] = solve_parents(parents, samples, cluster, cost, mode.repacks, est, _likely_slowest(parents, cluster, memo))
        parents, times = memo[key]
        if mode.widths:
            key += ("widths",)
            if key not in memo:
                memo[key] = solve_widths(parents, samples, cluster, cost, est, times)
            parents = memo[key]
    if mode.cheapest:
        parents = _no_slower_than_any_way(_cheapest(parents, length_of, cluster, cost), samples, cluster, cost, assignment_pricing, memo)
    if not mode.folded:
        parents = tuple(replace(p, redistributed=True) if p.repacked and not p.redistributed else p for p in parents)
    return tuple(parents)


def _started(start: str, cluster: Cluster, cost: CostModel, memo: dict) -> tuple[ParentPlan, ...]:
    """The assigned parents (memo["assignment"]), each wide one started as `start` says."""
    key = (start,)
    if key not in memo:
        if "node-local" not in memo:
            memo["node-local"] = [ParentPlan(g, (g,), NODE_LOCAL) for g in memo["assignment"] if g.size <= cluster.gpus_per_node]
        memo[key] = _parent_plans(memo["assignment"], memo["lengths"], cluster, cost, start, memo["node-local"])
    return memo[key]


def _likely_slowest(parents: Sequence[ParentPlan], cluster: Cluster, memo: dict) -> list[ParentPlan]:
    """Of the assigned parents (`parents`, in the assignment's order), the ones likely to end the
    step's stretches last: every parent wider than a node and the LIKELY_SLOWEST node-local ones
    the assignment's fill loaded most (memo["loads"]). A step priced over any subset of a plan's
    parents is no later than the plan's (each kind of stretch ends with its latest parent), so
    these bound the assigned parents' step from below at a few parents' price; at 4,096 ranks the
    bound is their step on the steps measured."""
    node = cluster.gpus_per_node
    if "likely" not in memo:  # the same node-local parents, in the same places, in every start
        loads = memo["loads"]
        local = [k for k, g in enumerate(memo["assignment"]) if g.size <= node]
        memo["likely"] = sorted(heapq.nlargest(LIKELY_SLOWEST, local, key=loads.__getitem__))
    return [p for p in parents if p.group.size > node] + [parents[k] for k in memo["likely"]]


LIKELY_SLOWEST = 64  # node-local parents in _likely_slowest


def _no_slower_than_any_way(
    chosen: tuple[ParentPlan, ...], samples: Sequence[Sample], cluster: Cluster, cost: CostModel, assignment_pricing: str, memo: dict
) -> tuple[ParentPlan, ...]:
    """The per-parent choice's plan, or the plan of a single way (every mode without the choice
    that this sparse kind can run) where that one's step is faster: a parent's cheapest way alone
    is not the step's, since the router's barrier makes each kind of layer wait for its own
    slowest rank. Compared by PlanEstimate.step_time, the step the simulator charges; the first
    of the fastest, in the table's order.

    The ways without the parent solver all keep the assignment's parents, so one
    PlanEstimate.floor_time of those bounds every one of their steps from below: where it is above
    the fastest step found among the others, none of them can be the fastest, and they are not
    planned."""
    if "estimate" not in memo:
        memo["estimate"] = PlanEstimate(memo["lengths"], cluster, cost)
    est = memo["estimate"]
    ways = [w for w in MODE_TABLE if not (w.cheapest or (w.needs_reach and cost.sparse.first_key is None))]
    solved = {w.name: _parents(w, samples, cluster, cost, assignment_pricing, memo) for w in ways if w.solver}
    low = min([est.step_time(chosen), *map(est.step_time, solved.values())])
    # the margin: the bound is summed in another order than the steps it bounds; the floor of the
    # likely slowest parents first (a bound of the floor), of all of them only where that is not enough
    own, bar = _started(OWN, cluster, cost, memo), low * (1 + 1e-9)
    if est.floor_time(_likely_slowest(own, cluster, memo)) > bar or est.floor_time(own) > bar:
        ways = [w for w in ways if w.solver]
    best, best_t = chosen, est.step_time(chosen)
    for way in ways:
        parents = solved[way.name] if way.solver else _parents(way, samples, cluster, cost, assignment_pricing, memo)
        t = est.step_time(parents)
        if t < best_t:
            best, best_t = parents, t
    return best


def make_plan(
    samples: Sequence[Sample], cluster: Cluster, cost: CostModel, mode: str = "repack+solver", assignment_pricing: str = "compute"
) -> StepPlan:
    """Plan one step in a declared mode (solver.modes).

    >>> from config import Cluster, HardwareConfig, ModelConfig
    >>> from solver import CostModel, samples_from_lengths
    >>> cost = CostModel(ModelConfig.from_name("paper"), HardwareConfig())
    >>> plan = make_plan(samples_from_lengths([200_000, 9_000, 3_000]), Cluster(16, 8, 16384), cost, "repack")
    >>> plan.widest_parent
    16
    """
    spec = mode_of(mode)
    cost = cost.for_cluster(cluster)
    check_heads(cluster, cost)
    if spec.needs_reach:
        cost.sparse.check_local(f"mode {mode}")
    with collector_paused():
        return compose(spec, check_samples(samples, cluster), cluster, cost, assignment_pricing)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, back as it was after it.

    A plan allocates hundreds of thousands of containers (heap entries, member lists, parents) and
    frees them by reference counting: the planner makes no reference cycles (a test holds it to
    that), so the collector finds nothing to free while it plans. It still runs, every few hundred
    allocations, and each full pass walks every object the process holds: at 16,384 ranks and
    half fill, in a fresh process, a baseline plan paid one such pass and a solver plan two, about
    30-45 ms each, more in a process that holds more (the bench's, or a trainer's). Pausing it for
    the plan drops that cost and leaks nothing."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def heads_of(cost: CostModel) -> str:
    """The heads a group splits: the attention's, and a linear kind's S layers' (solver.cost.ulysses_parts)."""
    m = cost.model
    return f"{m.n_heads} query / {m.n_kv_heads} key/value heads" + cost.sparse.heads_text(m)


def check_heads(cluster: Cluster, cost: CostModel) -> int:
    """The widest group the planner emits for this model on this cluster (CostModel.widest_group);
    SettingError when the node-local children, up to a node wide, could not split the model's heads."""
    widest = cost.widest_group(cluster)
    if cluster.gpus_per_node > widest:
        raise SettingError(
            f"gpus_per_node={cluster.gpus_per_node}: node-local children may be SP{cluster.gpus_per_node}, but the model's heads "
            f"({heads_of(cost)}) split over at most SP{widest}; use nodes of at most {widest} ranks "
            f"or a model whose query heads are a multiple of {cluster.gpus_per_node}"
        )
    return widest


def check_setup(cluster: Cluster, cost: CostModel, steps: Iterable[tuple[int, Sequence[int]]] = ()) -> str:
    """Check the model against the cluster, and every step's samples against both, before step 1:
    the widest group the planner may emit, head counts, node size, token budget. `steps` is
    (step number, lengths) pairs. Raises PlanError naming the first problem and the setting that
    would fix it; returns one line that says what the set-up allows."""
    m, w, t = cost.model, cluster.world_size, cluster.tokens_per_rank
    widest = check_heads(cluster, cost)
    for number, lengths in steps:
        n = np.asarray(lengths, dtype=np.int64)
        if n.size == 0 or n.min() < 1:
            raise PlanError(f"step {number}: lengths must be integers >= 1 and a step needs at least one sample; got {n.tolist()[:8]}")
        longest, total = int(n.max()), int(n.sum())
        if ceil_pow2(longest / t) > widest:
            raise PlanError(
                f"step {number}: a sample of {longest} tokens needs SP{ceil_pow2(longest / t)} at tokens_per_rank={t}, but groups "
                f"go up to SP{widest} (model {m.name}: {heads_of(cost)}, {w} ranks); "
                f"use tokens_per_rank >= {-(-longest // widest)} or shorter samples"
            )
        if total > w * t:
            raise PlanError(
                f"step {number}: the batch has {total} tokens but the cluster holds at most {w * t} ({w} ranks x "
                f"tokens_per_rank={t}); use tokens_per_rank >= {-(-total // w)} or fewer tokens per step"
            )
    replicated = f", key/value heads replicated on groups wider than SP{m.n_kv_heads}" if widest > m.n_kv_heads else ""
    return (
        f"model {m.name} ({heads_of(cost)}): groups up to SP{widest}{replicated}; "
        f"{w} ranks in nodes of {cluster.gpus_per_node}; {t} tokens per rank: samples up to {widest * t} tokens, "
        f"batches up to {w * t}"
    )
