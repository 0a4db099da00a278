"""One entry point: samples + cluster + cost model + mode -> a validated StepPlan."""

from __future__ import annotations

from collections.abc import Sequence

from .children import polish_children, solve_children
from .cluster import Cluster, PlanError, Sample, check_samples
from .cost import CostModel
from .estimate import PlanEstimate
from .layout import Group
from .parents import assign_parents, assign_with_children
from .plan import DISABLED, MODES, NODE_LOCAL, ParentPlan, StepPlan
from .rebalance import rebalance


def _parent_plans(
    groups: Sequence[Group], length_of: dict[int, int], cluster: Cluster, cost: CostModel, mode: str
) -> tuple[ParentPlan, ...]:
    parents = []
    for g in groups:
        if mode == "baseline":
            parents.append(ParentPlan(g, (g,), NODE_LOCAL if g.size <= cluster.gpus_per_node else DISABLED))
        else:
            kids, reason = solve_children(g, length_of, cluster, cost)
            parents.append(ParentPlan(g, kids, reason))
    return tuple(parents)


def plan_from_parents(groups: Sequence[Group], samples: Sequence[Sample], cluster: Cluster, cost: CostModel, mode: str) -> StepPlan:
    """Children for given parents (repack modes) or the parents' own layout (baseline)."""
    parents = _parent_plans(groups, {s.id: s.length for s in samples}, cluster, cost, mode)
    return StepPlan(cluster, tuple((s.id, s.length) for s in samples), parents, mode).validate()


# the parents within this fraction of the slowest also get a child solve from scratch
RESOLVE_NEAR_SLOWEST = 0.01


def solve_parents(baseline: Sequence[Group], samples: Sequence[Sample], cluster: Cluster, cost: CostModel) -> tuple[ParentPlan, ...]:
    """The parent solver: parents and children filled together (assign_with_children), polished
    by moves and swaps between parents (rebalance) and inside them (polish_children); the
    slowest parents also get a child solve from scratch, the faster of the two kept. The result
    is kept only if its estimate is no slower than the baseline parents with solved children
    (the repack plan), so it is never estimated slower than its input."""
    length_of = {s.id: s.length for s in samples}
    est = PlanEstimate(length_of, cluster, cost)
    base = _parent_plans(baseline, length_of, cluster, cost, "repack")
    try:
        start = assign_with_children(samples, cluster, cost)
    except PlanError:
        return base  # the joint fill may not fit where the baseline did: keep the baseline
    parents, times = [], []
    for g, kids in rebalance(start, length_of, cluster, cost):
        if kids is None:
            pp = ParentPlan(g, *solve_children(g, length_of, cluster, cost))
        else:
            pp = ParentPlan(g, *polish_children(g, kids, length_of, cluster, cost))
        parents.append(pp)
        times.append(est.parent_time(pp))
    slowest = max(times)
    for j, pp in enumerate(parents):
        if pp.group.size > cluster.gpus_per_node and times[j] >= (1 - RESOLVE_NEAR_SLOWEST) * slowest:
            alt = ParentPlan(pp.group, *solve_children(pp.group, length_of, cluster, cost))
            t = est.parent_time(alt)
            if t < times[j]:
                parents[j], times[j] = alt, t
    return tuple(parents) if max(times) <= est.plan_time(base) else base


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
    samples = check_samples(samples, cluster)
    groups = assign_parents(samples, cluster, cost, pricing=baseline_pricing)
    if mode == "repack+solver":
        parents = solve_parents(groups, samples, cluster, cost)
        return StepPlan(cluster, tuple((s.id, s.length) for s in samples), parents, mode).validate()
    return plan_from_parents(groups, samples, cluster, cost, mode)
