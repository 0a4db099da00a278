"""Parent assignment, child solver (against an exact MILP) and the parent solver."""

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import solver.parent_solver
from config import Cluster, HardwareConfig, ModelConfig, SettingError, WorkloadConfig
from solver import CostModel, Group, PlanError, Sample, StepPlan, TokenLayout, make_plan, samples_from_lengths
from solver.assignment import assign_parents
from solver.children import child_problem, polish_children, solve_child_problem, solve_children, solve_sorted
from solver.cluster import DENSE_DISTINCT, ceil_pow2, ceil_pow2_array, distinct
from solver.estimate import PlanEstimate
from solver.exact import solve_exact, solve_joint_exact
from solver.modes import MODE_TABLE, MODES
from solver.parent_solver import assign_with_children, joint_parents
from solver.plan import DISABLED, NODE_LOCAL, ParentPlan
from solver.rebalance import rebalance_parents
from tests.strategies import MILP_INSTANCES, batches, clusters, fits_memory_floors

HALO_MODES = tuple(m.name for m in MODE_TABLE if m.needs_reach or m.cheapest)  # the modes whose plans may hold halo children

TINY = CostModel(ModelConfig.from_name("tiny"), HardwareConfig())
PAPER = CostModel(ModelConfig.from_name("paper"), HardwareConfig())


def group_time(group: Group, lengths: np.ndarray, cluster: Cluster, cost: CostModel, repack: bool) -> float:
    """The tests' yardstick of a parent's estimated time: from its raw lengths (numpy sums), its
    children solved from scratch, independent of the cached sums of PlanEstimate and rebalance."""
    cost = cost.for_cluster(cluster)
    if len(lengths) == 0:
        return 0.0
    shared = cost.shared_time(float(cost.full_cost(lengths).sum()), group.size)
    own = cost.own_layout_time(lengths, group.size)
    g = cluster.gpus_per_node
    if repack and group.size > g and lengths.max() <= g * cluster.tokens_per_rank:
        sol = solve_sorted(tuple(sorted((int(n) for n in lengths), reverse=True)), group.size, cluster, cost)
        if sol is not None:
            return shared + min(own, sol.makespan)  # solve_children keeps the parent layout when it is faster
    return shared + own


def step_time(groups, length_of: dict[int, int], cluster: Cluster, cost: CostModel, repack: bool) -> float:
    """The yardstick's step estimate: the slowest parent group."""
    return max(group_time(g, np.array([length_of[s] for s in g.samples], dtype=np.int64), cluster, cost, repack) for g in groups)


def test_long_samples_get_wide_parents_and_short_ones_fill_them():
    cluster = Cluster(64, 8, 32768)
    rng = np.random.default_rng(0)
    lengths = [250_000] + list(rng.integers(500, 8000, 120))
    groups = assign_parents(samples_from_lengths(lengths), cluster, PAPER)
    wide = [g for g in groups if 0 in g.samples][0]
    assert wide.size >= 16
    assert sorted(r for g in groups for r in g.ranks) == list(range(64))
    assert sorted(s for g in groups for s in g.samples) == list(range(len(lengths)))


@pytest.mark.parametrize(
    "samples, match",
    [
        ([Sample(0, 10), Sample(0, 5)], "duplicate sample id=0"),
        ([Sample(0, 0)], "length=0"),
        ([Sample(0, -3)], "length=-3"),
        ([Sample(0, 8 * 128 + 1)], "cannot be placed: the widest aligned group"),
        ([Sample(i, 120) for i in range(9)], "the batch has 1080 tokens but the cluster holds at most 1024"),
        ([], "no samples"),
    ],
)
def test_bad_batches_raise_clear_errors(samples, match):
    with pytest.raises(PlanError, match=match):
        make_plan(samples, Cluster(8, 2, 128), TINY)


def test_unplaceable_sample_is_an_error_not_a_drop():
    # each sample needs 3 of a rank's 4 free... nothing fits beside another: 9 samples of 100 on 8 ranks
    with pytest.raises(PlanError, match="cannot be placed"):
        make_plan(samples_from_lengths([100] * 9), Cluster(8, 2, 128), TINY, "baseline")


def test_parent_too_long_for_a_node_keeps_its_layout_with_a_reason():
    cluster = Cluster(8, 2, 128)
    plan = make_plan(samples_from_lengths([600, 20, 20]), cluster, TINY, "repack")
    wide = plan.wide_parents()[0]
    assert not wide.repacked and "exceeds one node's capacity" in wide.reason


def child_instances(n_instances, seed0=0):
    cluster = Cluster(16, 8, 32768)
    for seed in range(seed0, seed0 + n_instances):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(3, 13))
        lengths = np.clip(rng.lognormal(9.5, 1.2, n), 16, 200_000).astype(int)
        while lengths.sum() > 0.9 * 16 * 32768:
            lengths = lengths[:-1]
        yield child_problem(lengths, 16, cluster, PAPER)


def test_child_heuristic_within_5pct_of_exact_on_95pct():
    gaps = []
    for p in child_instances(MILP_INSTANCES):
        h = solve_child_problem(p)
        e = solve_exact(p)
        assert h is not None and np.isfinite(e)
        assert h.makespan >= e * (1 - 1e-6), "the heuristic cannot beat the optimum"
        gaps.append(h.makespan / e - 1)
    assert np.mean(np.array(gaps) <= 0.05) >= 0.95, sorted(gaps)


def test_children_are_node_local_and_hold_the_parent_samples():
    cluster = Cluster(32, 8, 32768)
    rng = np.random.default_rng(3)
    lengths = {i: int(n) for i, n in enumerate([120_000] + list(rng.integers(100, 9000, 60)))}
    parent = Group(0, 32, tuple(lengths))
    kids, reason = solve_children(parent, lengths, cluster, PAPER)
    if kids == (parent,):
        assert reason
    else:
        assert sorted(s for c in kids for s in c.samples) == sorted(lengths)
        assert all(c.size <= 8 and c.start // 8 == (c.stop - 1) // 8 for c in kids)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(max_nodes=6).flatmap(lambda c: batches(c).map(lambda b: (c, b))))
def test_parent_solver_never_increases_the_estimate(case):
    cluster, samples = case
    length_of = {s.id: s.length for s in samples}
    groups = assign_parents(samples, cluster, TINY)
    new = rebalance_parents(groups, length_of, cluster, TINY)
    assert step_time(new, length_of, cluster, TINY, True) <= step_time(groups, length_of, cluster, TINY, True) * (1 + 1e-12)
    assert sorted(s for g in new for s in g.samples) == sorted(length_of)
    assert [(g.start, g.size) for g in new] == [(g.start, g.size) for g in groups]
    for g in new:
        assert sum(-(-length_of[s] // g.size) for s in g.samples) <= cluster.tokens_per_rank


def test_parent_solver_strictly_improves_a_clearly_unbalanced_case():
    cluster = Cluster(32, 8, 32768)
    lengths = {0: 100_000, 1: 100_000}
    lengths.update({i: 6000 for i in range(2, 40)})
    # all the short samples crowd the first wide parent; the second holds only its long sample
    groups = (Group(0, 16, tuple([0] + list(range(2, 40)))), Group(16, 16, (1,)))
    before = step_time(groups, lengths, cluster, PAPER, True)
    after = step_time(rebalance_parents(groups, lengths, cluster, PAPER), lengths, cluster, PAPER, True)
    assert after < 0.9 * before


# full attention heavy and cheap exchanges: wide parents whose children pay, at paper scale
FULL_HEAVY = CostModel(
    ModelConfig.from_name("paper").replace(layer_pattern="FFFS"), HardwareConfig(intra_node_bw=1e13, inter_intra_ratio=1.0)
)


@st.composite
def long_tailed_steps(draw):
    """Paper-scale steps on small clusters: a few long documents among many short ones, so that
    wide parents form (tiny token counts leave only the exchanges' latency to balance)."""
    g = draw(st.sampled_from([2, 4, 8]))
    cluster = Cluster(g * draw(st.integers(2, 8)), g, 32768)
    longs = draw(st.lists(st.integers(60_000, min(200_000, cluster.max_sample_length() // 2)), min_size=1, max_size=3))
    while not fits_memory_floors(longs, cluster):  # the long samples' memory floors must fit the cluster
        longs.pop()
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shorts = np.clip(rng.lognormal(7.5, 1.0, 12 * cluster.world_size), 1, 9000).astype(int).tolist()
    lengths, total = [], 0
    for n in longs + shorts:
        if total + n > 0.7 * cluster.world_size * cluster.tokens_per_rank:
            break
        lengths.append(n)
        total += n
    return cluster, samples_from_lengths(lengths)


def test_the_strategies_reject_a_batch_whose_memory_floors_do_not_fit():
    # found by an exploring run: two samples just over 4 x 32768 tokens (SP8 floors) and one of
    # 60000 (SP2) need 18 of 16 ranks; the strategies draw only batches whose floors fit
    cluster = Cluster(16, 4, 32768)
    infeasible = [60000, 131073, 131073] + [1000] * 21
    assert not fits_memory_floors(infeasible, cluster)
    with pytest.raises(PlanError, match="its long samples need 18 ranks"):
        make_plan(samples_from_lengths(infeasible), cluster, PAPER)
    assert fits_memory_floors(infeasible[:2] + infeasible[3:], cluster)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.one_of(clusters(max_nodes=6).flatmap(lambda c: batches(c).map(lambda b: (c, b))), long_tailed_steps()))
@example((Cluster(16, 4, 32768), samples_from_lengths([60000, 131073] + [1000] * 21)))
def test_joint_fill_places_every_sample_once_and_its_children_fit(case):
    cluster, samples = case
    length_of = {s.id: s.length for s in samples}
    try:
        start = assign_with_children(samples, cluster, FULL_HEAVY)
    except PlanError as e:  # the fill may not fit where another placement would: a named error
        assert "cannot be placed" in str(e)
        return
    assert sorted(r for g, _ in start for r in g.ranks) == list(range(cluster.world_size))
    assert sorted(s for g, _ in start for s in g.samples) == sorted(length_of)
    budget = cluster.tokens_per_rank
    for g, kids in start:
        assert sum(-(-length_of[s] // g.size) for s in g.samples) <= budget
        if kids is None:
            continue
        assert g.size > cluster.gpus_per_node and sum(c for c, _ in kids) == g.size
        assert sorted(s for _, m in kids for s in m) == sorted(g.samples)
        for c, m in kids:
            assert c <= cluster.gpus_per_node and sum(-(-length_of[s] // c) for s in m) <= budget
        # the planner's finishing step lays them out: they tile the parent, node-local, in budget
        children, reason = polish_children(g, kids, length_of, cluster, FULL_HEAVY)
        TokenLayout(children, {s: length_of[s] for s in g.samples}).validate(cluster, ranks=g.ranks, name="children")
        if children != (g,):
            assert not reason
            assert all(c.start // cluster.gpus_per_node == (c.stop - 1) // cluster.gpus_per_node for c in children)


def test_planner_keeps_the_repack_plan_when_the_parent_solver_does_worse(monkeypatch):
    cluster = Cluster(32, 8, 32768)
    rng = np.random.default_rng(0)
    samples = samples_from_lengths([120_000] + [int(n) for n in rng.integers(1, 9000, 150)])
    repack = make_plan(samples, cluster, FULL_HEAVY, "repack")
    # a parent solver whose own answer crowds every sample into the first parent
    first = repack.parents[0].group
    crowded = Group(first.start, first.size, tuple(s.id for s in samples))
    worse = (ParentPlan(crowded, (crowded,), DISABLED),) + tuple(
        ParentPlan(Group(p.group.start, p.group.size, ()), (Group(p.group.start, p.group.size, ()),), NODE_LOCAL)
        for p in repack.parents[1:]
    )
    est = PlanEstimate({s.id: s.length for s in samples}, cluster, FULL_HEAVY)
    assert est.plan_time(worse) > est.plan_time(repack.parents)
    monkeypatch.setattr(solver.parent_solver, "joint_parents", lambda *a: (worse, est.parent_times(worse).tolist()))
    assert make_plan(samples, cluster, FULL_HEAVY, "repack+solver").parents == repack.parents


def test_plan_estimate_agrees_with_group_time():
    cluster = Cluster(64, 8, 32768)
    rng = np.random.default_rng(5)
    lengths = [120_000, 70_000] + [int(n) for n in rng.integers(200, 9000, 150)]
    plan = make_plan(samples_from_lengths(lengths), cluster, PAPER, "repack")
    est = PlanEstimate(plan.length_of, cluster, PAPER)
    for p in plan.parents:
        n = np.array([plan.length_of[s] for s in p.group.samples], dtype=np.int64)
        assert est.parent_time(p) == pytest.approx(group_time(p.group, n, cluster, PAPER, True), rel=1e-9)


def test_polish_children_is_never_slower_than_its_start_and_rejects_bad_children():
    cluster = Cluster(32, 8, 32768)
    rng = np.random.default_rng(7)
    length_of = {i: int(n) for i, n in enumerate([60_000] + list(rng.integers(100, 9000, 70)))}
    parent = Group(0, 32, tuple(length_of))
    # a poor start: the long sample alone on 4 ranks, every short sample piled on one SP1 child
    kids = ((4, (0,)), (1, tuple(range(1, 71)))) + tuple((1, ()) for _ in range(27))
    est = PlanEstimate(length_of, cluster, PAPER)
    given_kids = ParentPlan(parent, tuple(Group(4 + k - 1 if k else 0, c, m) for k, (c, m) in enumerate(kids)), "")
    children, reason = polish_children(parent, kids, length_of, cluster, PAPER)
    assert reason == ""
    assert est.parent_time(ParentPlan(parent, children, "")) < 0.5 * est.parent_time(given_kids)
    with pytest.raises(ValueError, match="do not hold exactly the samples"):
        polish_children(parent, kids[:1] + kids[2:] + ((1, ()),), length_of, cluster, PAPER)


def test_joint_fill_gives_a_wide_parent_children_and_short_samples():
    cluster = Cluster(32, 8, 32768)
    rng = np.random.default_rng(0)
    lengths = [120_000] + [int(n) for n in rng.integers(1, 9000, 300)]
    while sum(lengths) > 0.7 * 32 * 32768:
        lengths.pop()
    samples = samples_from_lengths(lengths)
    wide = [(g, kids) for g, kids in assign_with_children(samples, cluster, FULL_HEAVY) if g.size > 8]
    assert len(wide) == 1 and 0 in wide[0][0].samples and wide[0][1] is not None
    assert len(wide[0][0].samples) > 1  # its other ranks took short samples
    est = PlanEstimate({s.id: s.length for s in samples}, cluster, FULL_HEAVY)
    repack = make_plan(samples, cluster, FULL_HEAVY, "repack").parents
    joint, _ = joint_parents(samples, cluster, FULL_HEAVY.for_cluster(cluster), est)
    assert est.plan_time(joint) < est.plan_time(repack)  # the joint fill lowers the slowest parent
    # the parent solver keeps it only where the whole step is no slower: here the router's barrier
    # makes the full layers wait for the slowest parent and the sparse ones for the slowest child,
    # and the joint plan's step is slower than repack's, so repack's plan comes back
    solved = make_plan(samples, cluster, FULL_HEAVY, "repack+solver").parents
    assert est.step_time(joint) > est.step_time(repack) and solved == repack
    # without the barrier the step waits once, for the slowest parent: the joint plan is kept
    free = CostModel(FULL_HEAVY.model, FULL_HEAVY.hw, costs=FULL_HEAVY.costs.replace(router_sync=False))
    est = PlanEstimate({s.id: s.length for s in samples}, cluster, free)
    solved = make_plan(samples, cluster, free, "repack+solver").parents
    assert est.step_time(solved) < est.step_time(make_plan(samples, cluster, free, "repack").parents)


def test_vectorized_pow2_matches_the_scalar_one_at_and_around_powers_of_two():
    x = np.concatenate(
        [
            np.random.default_rng(0).uniform(0, 100, 2000),
            2.0 ** np.arange(-3, 30),
            np.nextafter(2.0 ** np.arange(0, 30), np.inf),
            np.nextafter(2.0 ** np.arange(0, 30), 0),
            [0.0, 1.0, -1.0],
        ]
    )
    np.testing.assert_array_equal(ceil_pow2_array(x), [ceil_pow2(v) for v in x])


@pytest.mark.parametrize("high", [2, 64, 40_000, DENSE_DISTINCT + 5])
def test_distinct_by_table_is_numpys_unique_with_its_inverse(high):
    """distinct (a table over 0..max for the small sizes of a step's groups) gives np.unique's
    sorted values and inverse, on small keys, on keys past the table (np.unique's own path), on
    one value and on none."""
    rng = np.random.default_rng(high)
    for x in (rng.integers(0, high, 3000), rng.integers(0, high, 1), np.full(7, high - 1), np.zeros(0, dtype=np.int64)):
        got, want = distinct(x), np.unique(x, return_inverse=True)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_groups_are_never_wider_than_the_model_splits():
    # 32 query / 8 key-value heads: at most SP32 even on 256 ranks, where the longest sample's
    # cost share alone would ask for SP64
    cluster = Cluster(256, 8, 32768)
    rng = np.random.default_rng(2)
    lengths = [500_000] + [int(n) for n in rng.integers(100, 4000, 600)]  # memory floor SP16
    for mode in ("baseline", "repack+solver"):
        plan = make_plan(samples_from_lengths(lengths), cluster, PAPER, mode)
        assert plan.widest_parent == PAPER.widest_group(cluster) == 32
    wider = CostModel(PAPER.model.replace(n_heads=64), HardwareConfig())  # heads that split over SP64
    assert make_plan(samples_from_lengths(lengths), cluster, wider, "baseline").widest_parent == 64
    # a sample whose memory floor is wider than the heads split is a named error
    with pytest.raises(PlanError, match=r"needs SP16 .* heads \(8 query, 8 key/value\) split over at most SP8"):
        make_plan(samples_from_lengths([16 * 64]), Cluster(32, 8, 64), TINY)
    # key/value heads that do not divide the group and are not divided by it cap it too
    odd_kv = CostModel(ModelConfig.from_name("paper", n_heads=24, n_kv_heads=6), HardwareConfig())
    assert odd_kv.widest_group(Cluster(64, 8, 32768)) == 2


# ----- the width-choosing parent solver and the exact joint MILP -----------------------------------
def _estimate(plan_parents, samples, cluster, cost):
    """PlanEstimate's step time, parent by parent (not its vectorized parent_times)."""
    est = PlanEstimate({s.id: s.length for s in samples}, cluster, cost)
    return max(est.parent_time(pp) for pp in plan_parents)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(max_nodes=6).flatmap(lambda c: batches(c).map(lambda b: (c, b))))
def test_width_solver_is_never_slower_than_the_paper_solver_and_splits_the_heads(case):
    cluster, samples = case
    paper = make_plan(samples, cluster, TINY, "repack+solver")
    widths = make_plan(samples, cluster, TINY, "repack+widths")  # validated: every sample placed once, in budget
    assert _estimate(widths.parents, samples, cluster, TINY) <= _estimate(paper.parents, samples, cluster, TINY) * (1 + 1e-12)
    assert widths.widest_parent <= TINY.widest_group(cluster)


def _brute_force_optimum(samples, cluster, cost):
    """Every plan of a 4-rank cluster in nodes of 2, priced by PlanEstimate: every split of the
    ranks into parents, every child split of a parent wider than a node (or its own layout), every
    assignment of samples to the pieces that fit them. The MILP's yardstick."""
    import itertools

    from solver.layout import Group as G
    from solver.plan import ParentPlan as PP

    est = PlanEstimate({s.id: s.length for s in samples}, cluster, cost)
    budget, best = cluster.tokens_per_rank, float("inf")
    structures = []  # [(parent size, [child sizes] or None)]
    for sizes in ([4], [2, 2], [2, 1, 1], [1, 1, 1, 1]):
        if 4 in sizes:
            structures += [[(4, None)], [(4, [2, 2])], [(4, [2, 1, 1])], [(4, [1, 1, 1, 1])]]
        else:
            structures.append([(p, None) for p in sizes])
    for struct in structures:
        units = [(k, c) for k, (p, kids) in enumerate(struct) for c in (kids or [p])]
        for pick in itertools.product(range(len(units)), repeat=len(samples)):
            ok = all(-(-s.length // units[u][1]) <= budget for s, u in zip(samples, pick))
            by_parent = {}
            for s, u in zip(samples, pick):
                by_parent.setdefault(units[u][0], []).append(s.length)
            ok = ok and all(sum(-(-n // struct[k][0]) for n in ns) <= budget for k, ns in by_parent.items())
            ok = ok and all(
                sum(-(-s.length // units[u][1]) for s, uu in zip(samples, pick) if uu == u) <= budget for u in range(len(units))
            )
            if not ok:
                continue
            parents, at = [], 0
            for k, (p, kids) in enumerate(struct):
                members = tuple(s.id for s, u in zip(samples, pick) if units[u][0] == k)
                g = G(at, p, members)
                if kids is None:
                    parents.append(PP(g, (g,), ""))
                else:
                    off, children = at, []
                    for u, (kk, c) in enumerate(units):
                        if kk == k:
                            children.append(G(off, c, tuple(s.id for s, uu in zip(samples, pick) if uu == u)))
                            off += c
                    parents.append(PP(g, tuple(children), ""))
                at += p
            best = min(best, max(est.parent_time(pp) for pp in parents))
    return best


@pytest.mark.parametrize("lengths", [[300, 40, 17, 9], [129, 100, 64, 3], [250, 200, 5]], ids=str)
def test_joint_milp_finds_the_brute_force_optimum(lengths):
    cluster = Cluster(4, 2, 128)
    samples = samples_from_lengths(lengths)
    opt = solve_joint_exact(samples, cluster, PAPER)
    assert opt.proven
    assert opt.time == pytest.approx(_brute_force_optimum(samples, cluster, PAPER), rel=1e-9)


@pytest.mark.parametrize("seed", [3, 7])
def test_joint_milp_optimum_is_a_valid_plan_that_no_mode_beats(seed):
    from experiments.bench.solver import joint_instance

    cluster, lengths = joint_instance(seed)
    samples = samples_from_lengths(lengths)
    opt = solve_joint_exact(samples, cluster, PAPER)
    plan = StepPlan(cluster, tuple((s.id, s.length) for s in samples), opt.parents, "repack+widths").validate()
    assert opt.proven and _estimate(plan.parents, samples, cluster, PAPER) == pytest.approx(opt.time, rel=1e-9)
    for mode in (m for m in MODES if m not in HALO_MODES):  # the optimum is over plans of Ulysses children
        assert _estimate(make_plan(samples, cluster, PAPER, mode).parents, samples, cluster, PAPER) >= opt.time * (1 - 1e-9)


# ----- the declared modes (solver.modes) ------------------------------------------------------------
def test_every_declared_mode_plans_what_its_stages_say():
    """Each mode's plan, from its record alone: wide parents start as `start` says (repacked or
    not, halo children or not), only a repacked parent redistributes and only in a mode that does
    not fold, and the per-parent choice never leaves a wide parent in a way its stages exclude."""
    from solver.modes import CHILDREN, HALO_CHILDREN, MODE_TABLE, OWN, OWN_HALO

    cluster = Cluster(16, 4, 256)
    cost = CostModel(ModelConfig.from_name("tiny"), HardwareConfig())
    samples = samples_from_lengths([900, 500, 300, 120, 60, 40, 30, 25, 20, 10, 9, 8])
    for mode in MODE_TABLE:
        plan = make_plan(samples, cluster, cost, mode.name)
        wide = plan.wide_parents()
        assert wide, mode.name
        for p in plan.parents:
            assert p.redistributed == (not mode.folded and p.repacked), (mode.name, p)
        if mode.cheapest:
            continue
        for p in wide:
            if mode.start == OWN:
                assert not p.repacked and not p.halo, (mode.name, p)
            elif mode.start == OWN_HALO:
                assert not p.repacked and p.halo, (mode.name, p)
            elif mode.start == HALO_CHILDREN:
                assert all(c.halo or c.size == 1 for c in p.children), (mode.name, p)  # long samples cut, the rest whole
            elif mode.start == CHILDREN:
                assert not p.halo and all(not c.spans_nodes(4) for c in p.children), (mode.name, p)


def test_twins_isolate_one_stage_and_unknown_modes_or_stages_are_named():
    from solver.modes import OWN, mode_of, twin

    assert twin("redistribute", folded=True) == "repack+solver"
    assert twin("repack+solver", start=OWN) == "baseline+solver"
    assert twin("choose", cheapest=False) == "repack+widths"
    assert twin("halo", solver=True) is None  # no such mode declared
    with pytest.raises(ValueError, match="no stage 'colour'"):
        twin("repack", colour=1)
    with pytest.raises(SettingError, match=r"mode='repak' is invalid: it must be one of \['baseline', 'repack'"):
        mode_of("repak")


def test_a_plan_that_breaks_an_invariant_is_a_bug_with_its_cause_not_a_users_error():
    from solver.cluster import InternalError, PlanInvariantError
    from solver.layout import Group
    from solver.plan import StepPlan

    cluster = Cluster(4, 2, 64)
    twice = (
        ParentPlan(Group(0, 2, (0,)), (Group(0, 2, (0,)),), NODE_LOCAL),
        ParentPlan(Group(2, 2, (0,)), (Group(2, 2, (0,)),), NODE_LOCAL),
    )
    with pytest.raises(
        PlanInvariantError, match=r"bug: a repack plan breaks an invariant \(.*placed twice.*\); the solvers must never"
    ) as e:
        StepPlan(cluster, ((0, 10),), twice, "repack").validate()
    assert isinstance(e.value, InternalError) and not isinstance(e.value, PlanError) and isinstance(e.value.__cause__, PlanError)
    # a redistribution for a parent that keeps its layout: refused the same way
    whole = Group(0, 4, (0,))
    with pytest.raises(PlanInvariantError, match="redistributes but is not repacked"):
        StepPlan(cluster, ((0, 10),), (ParentPlan(whole, (whole,), DISABLED, redistributed=True),), "redistribute").validate()
    # a sample no group can hold stays the user's error: one line, naming it
    with pytest.raises(PlanError, match="cannot be placed"):
        make_plan(samples_from_lengths([64 * 4 + 1]), cluster, TINY)


def test_choose_is_never_slower_than_any_single_way():
    """choose's simulated step is never slower than the fastest of the modes without the choice on
    the same step (a parent's cheapest way alone is not the step's: the router's barrier makes
    each kind of layer wait for its own slowest rank), on the ablation's steps (the default
    workload at 32 and 64 ranks) and on random ones; and more than one single way is the
    fastest somewhere, so the choice has something to choose."""
    from experiments.common.workload import generate_steps  # noqa: PLC0415
    from solver.simulator import simulate  # noqa: PLC0415

    singles = [m.name for m in MODE_TABLE if not m.cheapest]
    steps = []
    for w in (32, 64):
        cluster = Cluster(w, 8, 32768)
        steps += [(cluster, n) for n in generate_steps(WorkloadConfig().replace(steps=3, seed=w).for_cluster(cluster))]
    for seed in (0, 3, 4, 29):  # random steps; on 3, 4 and 29 a parent's cheapest way alone loses to a single way
        rng = np.random.default_rng(seed)
        w = int(rng.choice([16, 32, 64]))
        cluster, lengths = Cluster(w, 8, 32768), []
        cap = rng.uniform(0.5, 0.95) * w * 32768
        while True:
            n = int(rng.lognormal(8.5, 1.3)) + 16 if rng.random() > 0.05 else int(rng.integers(40_000, 300_000))
            if sum(lengths) + n > cap:
                break
            lengths.append(min(n, 16 * 32768))
        steps.append((cluster, lengths))
    fastest = set()
    for cluster, lengths in steps:
        samples = samples_from_lengths(lengths)
        step = {m: simulate(make_plan(samples, cluster, PAPER, m), PAPER).step_time for m in [*singles, "choose"]}
        best = min(singles, key=step.get)
        fastest.add(best)
        assert step["choose"] <= step[best] * (1 + 1e-12), (cluster, best, step)
    assert len(fastest) > 1


def test_the_assignment_and_the_joint_fill_share_one_steps_anchors_and_never_another_steps():
    """anchor_groups keeps its answer for the checked step the assignment and the joint fill both
    start from: the same step, cluster and cost model get the same answer (read-only), and a new
    step, even one with the same ids, or another cost model, gets its own."""
    from solver.assignment import _anchor_groups, anchor_groups
    from solver.cluster import check_samples

    cluster = Cluster(64, 8, 32768)
    cost = PAPER.for_cluster(cluster)
    first = check_samples(samples_from_lengths([200_000, 70_000] + [9_000, 3_000] * 20), cluster)
    a = anchor_groups(first, cluster, cost)
    assert anchor_groups(first, cluster, cost) is a
    with pytest.raises(ValueError, match="read-only"):
        a[0][0] = 1
    second = check_samples(samples_from_lengths([9_000, 3_000] * 40 + [120_000]), cluster)  # the same ids 0.., other lengths
    b = anchor_groups(second, cluster, cost)
    fresh = _anchor_groups(second, cluster, cost, 0)
    assert b is not a and b[0].tolist() == fresh[0].tolist() and b[2:] == tuple(map(tuple, fresh[2:]))
    narrowed = anchor_groups(second, cluster, cost, 1)  # the assignment's retry with a narrower anchor
    assert narrowed[3] == tuple(_anchor_groups(second, cluster, cost, 1)[3]) != b[3]
    tiny = TINY.for_cluster(cluster)
    assert anchor_groups(second, cluster, tiny)[1].tolist() == _anchor_groups(second, cluster, tiny, 0)[1].tolist() != b[1].tolist()


def test_choose_shares_the_joint_fill_between_its_ways_only_where_no_parent_gets_children():
    """The joint fill depends on repacking only through the children it gives wide parents: where
    it gives none, the fill without repacking (baseline+solver's, which choose plans on the same
    step) is the fill with it, shared; where a parent gets children, each is its own, and each is
    what a fresh fill of that step gives."""
    cluster = Cluster(32, 8, 32768)
    rng = np.random.default_rng(0)
    lengths = [120_000] + [int(n) for n in rng.integers(1, 9000, 300)]
    while sum(lengths) > 0.7 * 32 * 32768:
        lengths.pop()

    def fresh(cost, repack):  # the same samples in a new tuple: nothing kept from another call
        return assign_with_children(tuple(samples_from_lengths(lengths)), cluster, cost, repack)

    from solver.cluster import check_samples

    for cost, children in ((FULL_HEAVY, True), (PAPER, False)):
        samples = check_samples(samples_from_lengths(lengths), cluster)
        with_kids = assign_with_children(samples, cluster, cost, True)
        assert any(kids is not None for _, kids in with_kids) == children
        without = assign_with_children(samples, cluster, cost, False)
        assert (without is with_kids) == (not children)
        assert with_kids == fresh(cost, True) and without == fresh(cost, False)


@pytest.mark.parametrize("mode", MODES)
def test_a_plan_makes_no_reference_cycles_and_leaves_the_collector_as_it_was(mode):
    """make_plan pauses Python's cyclic collector while it plans (planner.collector_paused). That
    costs nothing only if a plan makes no reference cycles: all it allocates and drops must be
    freed by reference counting, so a collection right after a plan finds nothing (the fills
    once held their own bound methods, leaving thousands of objects per plan to the collector).
    With the collector paused every object the plan makes stays in the youngest generation, so a
    collection of that generation sees them all. Wide parents, children, halo children and the
    joint fill all run on these steps. The collector comes back as it was, enabled or not, also
    when the plan fails."""
    import gc  # noqa: PLC0415

    cluster = Cluster(64, 8, 32768)
    steps = [[250_000, 120_000, *range(500, 8000, 97)], [30_000] * 40 + [700] * 300]
    was = gc.isenabled()
    try:
        gc.enable()
        make_plan(samples_from_lengths(steps[0]), cluster, PAPER, mode)
        assert gc.isenabled()
        for lengths in steps:
            gc.disable()
            gc.collect(0)
            make_plan(samples_from_lengths(lengths), cluster, PAPER, mode)
            assert not gc.isenabled()
            assert gc.collect(0) == 0, f"{mode} left objects in reference cycles"
        gc.enable()
        with pytest.raises(PlanError, match="cannot be placed|does not fit|tokens but the cluster"):
            make_plan(samples_from_lengths([32768] * 65), cluster, PAPER, mode)
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_a_parent_no_children_can_speed_up_keeps_its_layout_as_the_exact_optimum_says():
    """solve_children skips the child solve where the child problem's lower bound is no faster
    than the parent's own layout. Held to the exact MILP optimum: on parents where that shortcut
    is taken, no assignment of children beats the own layout; on a parent where it is not, the
    solve still runs and repacks it."""
    cluster = Cluster(16, 8, 32768)
    cost = PAPER.for_cluster(cluster)
    rng = np.random.default_rng(5)
    taken = 0
    for anchor, shorts in ((250_000, 12), (200_000, 6), (60_000, 20)):
        lengths = {i: int(n) for i, n in enumerate([anchor, *rng.integers(200, 4000, shorts)])}
        parent = Group(0, 16, tuple(lengths))
        ordered = np.array(sorted(lengths.values(), reverse=True), dtype=np.int64)
        p = child_problem(ordered, 16, cluster, cost)
        own = cost.own_layout_time(ordered, 16)
        kids, reason = solve_children(parent, lengths, cluster, cost)
        if p.lower_bound() >= own:
            taken += 1
            assert kids == (parent,) and reason.startswith("repacking does not pay: any children take at least"), reason
            assert solve_exact(p) >= own * (1 - 1e-9)
        else:
            assert kids != (parent,) and not reason, reason
    assert 0 < taken < 3  # both paths ran


def test_the_parent_solver_bounding_the_start_by_its_likely_slowest_parents_keeps_its_answer():
    """solve_parents given `likely` (the planner's _likely_slowest: the assigned parents wider
    than a node and the node-local ones the assignment loaded most) keeps the joint plan without
    pricing every parent of the start where its step is no later than a step of those alone. That
    step is a lower bound of the start's (checked), so the answer is the one pricing the whole
    start gives, with and without repacking, on the default workload's steps at 256 and 1,024
    ranks; and the bound decides most of them (it is what saves the time)."""
    from experiments.common.workload import generate_steps  # noqa: PLC0415
    from solver.assignment import assign_parents_loaded  # noqa: PLC0415
    from solver.modes import CHILDREN, OWN  # noqa: PLC0415
    from solver.parent_solver import solve_parents  # noqa: PLC0415
    from solver.planner import _likely_slowest, _started  # noqa: PLC0415

    decided = total = 0
    for w in (256, 1024):
        cluster = Cluster(w, 8, 32768)
        cost = PAPER.for_cluster(cluster)
        for lengths in generate_steps(WorkloadConfig().replace(steps=2, seed=w).for_cluster(cluster)):
            samples = samples_from_lengths(lengths)
            memo = {"lengths": dict(enumerate(lengths))}
            memo["assignment"], memo["loads"] = assign_parents_loaded(samples, cluster, cost)
            for start_name, repack in ((CHILDREN, True), (OWN, False)):
                start = _started(start_name, cluster, cost, memo)
                likely = _likely_slowest(start, cluster, memo)
                assert len(likely) < len(start)
                est = PlanEstimate(memo["lengths"], cluster, cost)
                bound = est.step_time(likely)
                assert bound <= est.step_time(start)
                got = solve_parents(start, samples, cluster, cost, repack, PlanEstimate(memo["lengths"], cluster, cost), likely)
                want = solve_parents(start, samples, cluster, cost, repack, PlanEstimate(memo["lengths"], cluster, cost))
                assert got[0] == want[0], (w, start_name)
                total += 1
                decided += got[0] is not start and est.step_time(got[0]) <= bound
    assert decided >= total // 2, (decided, total)
