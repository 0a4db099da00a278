"""One entry point: samples + cluster + cost model + mode -> a validated StepPlan.

The planner only dispatches the modes: the baseline assignment (solver.baseline) gives every
mode its parents; repack adds the child solver's children (solver.children); repack+solver
hands both to the parent solver (solver.parent_solver); baseline+solver runs the parent solver
with every parent in its own layout, the control that shows how much of repack+solver is the
parent solver's doing and how much the repacking's.
"""

from __future__ import annotations

from collections.abc import Sequence

from .baseline import assign_parents
from .children import solve_children
from .cluster import Cluster, PlanError, Sample, check_samples
from .cost import CostModel
from .layout import Group
from .parent_solver import solve_parents
from .plan import DISABLED, MODES, NODE_LOCAL, ParentPlan, StepPlan


def _parent_plans(
    groups: Sequence[Group], length_of: dict[int, int], cluster: Cluster, cost: CostModel, mode: str
) -> tuple[ParentPlan, ...]:
    parents = []
    for g in groups:
        if mode == "baseline":
            parents.append(ParentPlan(g, (g,), NODE_LOCAL if g.size <= cluster.gpus_per_node else DISABLED))
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

    >>> from solver import Cluster, CostModel, ModelConfig, HardwareConfig, samples_from_lengths
    >>> cost = CostModel(ModelConfig.from_name("paper"), HardwareConfig())
    >>> plan = make_plan(samples_from_lengths([200_000, 9_000, 3_000]), Cluster(16, 8, 16384), cost, "repack")
    >>> plan.widest_parent
    16
    """
    if mode not in MODES:
        raise PlanError(f"mode={mode!r}; valid modes: {MODES}")
    cost = cost.for_cluster(cluster)
    samples = check_samples(samples, cluster)
    groups = assign_parents(samples, cluster, cost, pricing=baseline_pricing)
    if mode in ("repack+solver", "baseline+solver"):
        repack = mode == "repack+solver"
        start = _parent_plans(groups, {s.id: s.length for s in samples}, cluster, cost, "repack" if repack else "baseline")
        parents = solve_parents(start, samples, cluster, cost, repack)
        return StepPlan(cluster, tuple((s.id, s.length) for s in samples), parents, mode).validate()
    return plan_from_parents(groups, samples, cluster, cost, mode)
