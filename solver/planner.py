"""One entry point: samples + cluster + cost model + mode -> a validated StepPlan."""

from __future__ import annotations

from collections.abc import Sequence

from .children import solve_children
from .cluster import Cluster, PlanError, Sample, check_samples
from .cost import CostModel
from .estimate import step_time
from .layout import Group
from .parents import assign_parents
from .plan import DISABLED, MODES, NODE_LOCAL, ParentPlan, StepPlan
from .rebalance import rebalance_parents


def plan_from_parents(groups: Sequence[Group], samples: Sequence[Sample], cluster: Cluster, cost: CostModel, mode: str) -> StepPlan:
    """Children for given parents (repack modes) or the parents' own layout (baseline)."""
    length_of = {s.id: s.length for s in samples}
    parents = []
    for g in groups:
        if mode == "baseline":
            parents.append(ParentPlan(g, (g,), NODE_LOCAL if g.size <= cluster.gpus_per_node else DISABLED))
        else:
            kids, reason = solve_children(g, length_of, cluster, cost)
            parents.append(ParentPlan(g, kids, reason))
    plan = StepPlan(cluster, tuple((s.id, s.length) for s in samples), tuple(parents), mode)
    return plan.validate()


def solve_parents(baseline: tuple[Group, ...], samples: Sequence[Sample], cluster: Cluster, cost: CostModel) -> tuple[Group, ...]:
    """The parent solver: the better of (a) the baseline parents rebalanced by moves and swaps and
    (b) a repack-aware parent assignment, rebalanced likewise. Candidates are compared with quick
    child solves; the winner is kept only if its full estimate is no slower than the baseline
    parents' (with children), so the result is never estimated slower than its input."""
    length_of = {s.id: s.length for s in samples}
    starts = [baseline]
    try:
        starts.append(assign_parents(samples, cluster, cost, repack_aware=True))
    except PlanError:
        pass  # the repack-aware fill may not fit where the baseline did; keep the baseline start
    cands = [rebalance_parents(start, length_of, cluster, cost) for start in starts]
    best = min(cands, key=lambda g: step_time(g, length_of, cluster, cost, True, quick=True))
    if step_time(best, length_of, cluster, cost, True) <= step_time(baseline, length_of, cluster, cost, True):
        return best
    return baseline


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
        groups = solve_parents(groups, samples, cluster, cost)
    return plan_from_parents(groups, samples, cluster, cost, mode)
