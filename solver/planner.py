"""One entry point: samples + cluster + cost model + mode -> a validated StepPlan.

The planner only dispatches the modes: the baseline assignment (solver.baseline) gives every
mode its parents; repack adds the child solver's children (solver.children); repack+solver
hands both to the parent solver (solver.parent_solver); baseline+solver runs the parent solver
with every parent in its own layout, the control that shows how much of repack+solver is the
parent solver's doing and how much the repacking's; repack+widths hands repack+solver's plan to
the width-choosing solver (solver.width_solver), beyond the paper. The other ways to run the
sparse layers (solver.halo): redistribute is repack+solver's plan run with the layout changed by
an all-to-all of its own at every full/sparse boundary; halo gives the baseline's wide parents
halo children; parent+halo keeps their own layout with halo attention; choose takes
repack+widths' plan and runs each wide parent the cheapest way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from config import HALO_MODES, MODES, SettingError

from .baseline import assign_parents
from .children import solve_children
from .cluster import Cluster, PlanError, Sample, ceil_pow2, check_samples
from .cost import CostModel
from .estimate import PlanEstimate
from .halo import choose_children, halo_parent, solve_halo_children
from .layout import Group
from .parent_solver import solve_parents
from .plan import DISABLED, NODE_LOCAL, ParentPlan, StepPlan
from .width_solver import solve_widths


def _parent_plans(
    groups: Sequence[Group], length_of: dict[int, int], cluster: Cluster, cost: CostModel, mode: str
) -> tuple[ParentPlan, ...]:
    parents = []
    for g in groups:
        if g.size <= cluster.gpus_per_node and mode != "baseline":
            parents.append(ParentPlan(g, (g,), NODE_LOCAL))
        elif mode == "baseline":
            parents.append(ParentPlan(g, (g,), NODE_LOCAL if g.size <= cluster.gpus_per_node else DISABLED))
        elif mode == "halo":
            parents.append(ParentPlan(g, *solve_halo_children(g, length_of, cluster, cost)))
        elif mode == "parent+halo":
            parents.append(halo_parent(g))
        else:
            parents.append(ParentPlan(g, *solve_children(g, length_of, cluster, cost)))
    return tuple(parents)


def plan_from_parents(groups: Sequence[Group], samples: Sequence[Sample], cluster: Cluster, cost: CostModel, mode: str) -> StepPlan:
    """Children for given parents (repack modes) or the parents' own layout (baseline)."""
    cost = cost.for_cluster(cluster)
    parents = _parent_plans(groups, {s.id: s.length for s in samples}, cluster, cost, mode)
    return StepPlan(cluster, tuple((s.id, s.length) for s in samples), parents, mode).validate()


def make_plan(
    samples: Sequence[Sample], cluster: Cluster, cost: CostModel, mode: str = "repack+solver", baseline_pricing: str = "compute"
) -> StepPlan:
    """Plan one step.

    >>> from config import Cluster, HardwareConfig, ModelConfig
    >>> from solver import CostModel, samples_from_lengths
    >>> cost = CostModel(ModelConfig.from_name("paper"), HardwareConfig())
    >>> plan = make_plan(samples_from_lengths([200_000, 9_000, 3_000]), Cluster(16, 8, 16384), cost, "repack")
    >>> plan.widest_parent
    16
    """
    if mode not in MODES:
        raise SettingError(f"mode={mode!r} is invalid: it must be one of {list(MODES)}")
    cost = cost.for_cluster(cluster)
    check_heads(cluster, cost)
    if mode in HALO_MODES[:2]:
        cost.sparse.check_local(f"mode {mode}")
    samples = check_samples(samples, cluster)
    if mode == "redistribute":  # repack+solver's parents and children; the simulator and runtime change the layout apart
        solved = make_plan(samples, cluster, cost, "repack+solver", baseline_pricing)
        return StepPlan(cluster, solved.lengths, solved.parents, mode).validate()
    if mode == "choose":  # repack+widths' parents, each wide one running the cheapest way (solver.halo)
        solved = make_plan(samples, cluster, cost, "repack+widths", baseline_pricing)
        length_of = solved.length_of
        parents = tuple(
            choose_children(p.group, (p.children, "") if p.repacked else ((p.group,), p.reason), length_of, cluster, cost)
            if p.group.size > cluster.gpus_per_node
            else p
            for p in solved.parents
        )
        return StepPlan(cluster, solved.lengths, parents, mode).validate()
    groups = assign_parents(samples, cluster, cost, pricing=baseline_pricing)
    if mode in ("repack+solver", "baseline+solver", "repack+widths"):
        repack = mode != "baseline+solver"
        length_of = {s.id: s.length for s in samples}
        start = _parent_plans(groups, length_of, cluster, cost, "repack" if repack else "baseline")
        est = PlanEstimate(length_of, cluster, cost)  # one per step, shared by the solvers
        parents, times = solve_parents(start, samples, cluster, cost, repack, est)
        if mode == "repack+widths":
            parents = solve_widths(parents, samples, cluster, cost, est, times)
        return StepPlan(cluster, tuple((s.id, s.length) for s in samples), parents, mode).validate()
    return plan_from_parents(groups, samples, cluster, cost, mode)


def check_heads(cluster: Cluster, cost: CostModel) -> int:
    """The widest group the planner emits for this model on this cluster (CostModel.widest_group);
    SettingError when the node-local children, up to a node wide, could not split the model's heads."""
    m, widest = cost.model, cost.widest_group(cluster)
    if cluster.gpus_per_node > widest:
        raise SettingError(
            f"gpus_per_node={cluster.gpus_per_node}: node-local children may be SP{cluster.gpus_per_node}, but the model's heads "
            f"({m.n_heads} query, {m.n_kv_heads} key/value) split over at most SP{widest}; use nodes of at most {widest} ranks "
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
                f"go up to SP{widest} (model {m.name}: {m.n_heads} query / {m.n_kv_heads} key/value heads, {w} ranks); "
                f"use tokens_per_rank >= {-(-longest // widest)} or shorter samples"
            )
        if total > w * t:
            raise PlanError(
                f"step {number}: the batch has {total} tokens but the cluster holds at most {w * t} ({w} ranks x "
                f"tokens_per_rank={t}); use tokens_per_rank >= {-(-total // w)} or fewer tokens per step"
            )
    replicated = f", key/value heads replicated on groups wider than SP{m.n_kv_heads}" if widest > m.n_kv_heads else ""
    return (
        f"model {m.name} ({m.n_heads} query / {m.n_kv_heads} key/value heads): groups up to SP{widest}{replicated}; "
        f"{w} ranks in nodes of {cluster.gpus_per_node}; {t} tokens per rank: samples up to {widest * t} tokens, "
        f"batches up to {w * t}"
    )
