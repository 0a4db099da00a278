"""The solvers' fast paths price a parent as the slow, readable definition does (solver.reference):
PlanEstimate (one parent, and many at once with numpy), the parent solver's joint fill (a bin's
time, and the bin a placement picks), the rebalance's trial moves, and the child solver's child
time, on random parents, children, samples and hardware; and the price of a whole plan's step
(PlanEstimate.step_time) is the simulator's, in every mode."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from config import Cluster, CostsConfig, HardwareConfig, ModelConfig
from solver import CostModel, Group, Way, make_plan, samples_from_lengths
from solver import reference as ref
from solver.children import child_problem
from solver.estimate import PlanEstimate
from solver.halo import own_layout_halo, passing_way, solve_halo_children
from solver.modes import MODE_TABLE
from solver.parent_solver import _BinFill
from solver.plan import NODE_LOCAL, ParentPlan, StepPlan
from solver.rebalance import _GroupState, _StepPrices
from solver.simulator import simulate
from tests.strategies import batches, clusters

REL = 1e-9  # the fast paths sum in another order


@st.composite
def costs(draw, pipelined: bool = False):
    """A cost model with every term switched on somewhere: both ratio readings, latencies inside
    and across nodes, per peer of an all-to-all and per sample of an attention call, every
    recompute, the router's barrier on and off; attention and linear (Gated DeltaNet) S layers;
    `pipelined`: exchanges pipelined in head blocks too (overlap_blocks)."""
    model = ModelConfig.from_name(draw(st.sampled_from(["tiny", "tiny-gqa", "paper", "tiny-gdn", "paper-gdn"])))
    hw = HardwareConfig(
        ratio_reading=draw(st.sampled_from(["group", "link"])),
        inter_intra_ratio=draw(st.sampled_from([1.0, 3.5, 7.0])),
        a2a_latency=draw(st.sampled_from([0.0, 25e-6])),
        a2a_inter_latency=draw(st.sampled_from([0.0, 1e-3])),
        a2a_peer_latency=draw(st.sampled_from([0.0, 4e-4])),
        attention_sample_latency=draw(st.sampled_from([0.0, 2e-4])),
    )
    costs = CostsConfig(
        recompute=draw(st.sampled_from(["full", "selective", "none"])),
        router_sync=draw(st.booleans()),
        overlap_blocks=draw(st.sampled_from([1, 2, 8])) if pipelined else 1,
    )
    return CostModel(model, hw, costs=costs)


@st.composite
def node_split(draw, node: int) -> list[int]:
    """A node's ranks cut into aligned power-of-two children, in rank order."""
    if node == 1 or draw(st.booleans()):
        return [node]
    return draw(node_split(node // 2)) + draw(node_split(node // 2))


@st.composite
def parents(draw):
    """(cluster, cost, parent plan, length_of): a parent (wide or node-local) at an aligned start,
    its node-local children (or itself), and samples assigned to them at random."""
    node = draw(st.sampled_from([1, 2, 4, 8]))
    size = node * draw(st.sampled_from([1, 2, 4]))
    cluster = Cluster(2 * size, node, 4096)
    start = draw(st.sampled_from([0, size]))
    sizes = [c for _ in range(size // node) for c in draw(node_split(node))] if size > node else [size]
    n = draw(st.integers(1, 14))
    lengths = draw(st.lists(st.one_of(st.integers(1, 256), st.integers(256, 3 * 4096)), min_size=n, max_size=n))
    owner = draw(st.lists(st.integers(0, len(sizes) - 1), min_size=n, max_size=n))
    at, children = start, []
    for k, c in enumerate(sizes):
        children.append(Group(at, c, tuple(i for i in range(n) if owner[i] == k)))
        at += c
    group = Group(start, size, tuple(range(n)))
    repacked = size > node
    plan = ParentPlan(group, tuple(children) if repacked else (group,), "" if repacked else NODE_LOCAL)
    return cluster, draw(costs()).for_cluster(cluster), plan, dict(enumerate(lengths))


@given(parents())
def test_plan_estimate_prices_a_parent_as_the_reference(case):
    cluster, cost, plan, length_of = case
    est = PlanEstimate(length_of, cluster, cost)
    own = ParentPlan(plan.group, (plan.group,), "its own layout")
    want = [ref.parent_time(plan, length_of, cost), ref.parent_time(own, length_of, cost)]
    assert est.parent_time(plan) == pytest.approx(want[0], rel=REL)
    np.testing.assert_allclose(est.parent_times([plan, own]), want, rtol=REL)


@given(st.data())
def test_every_modes_plan_is_priced_as_the_reference(data):
    cluster = data.draw(clusters(max_nodes=4))
    samples = data.draw(batches(cluster, fill=0.6))
    cost = data.draw(costs()).for_cluster(cluster)
    length_of = {s.id: s.length for s in samples}
    est = PlanEstimate(length_of, cluster, cost)
    for mode in ("baseline", "repack", "repack+solver", "repack+widths"):
        plan = make_plan(samples, cluster, cost, mode)
        want = [ref.parent_time(p, length_of, cost) for p in plan.parents]
        np.testing.assert_allclose(est.parent_times(plan.parents), want, rtol=REL, err_msg=mode)


@settings(max_examples=25, deadline=None)  # nine modes planned and simulated per example
@given(st.data())
def test_the_step_estimate_is_the_simulators_step_in_every_mode(data):
    """PlanEstimate.step_time, the price the solvers compare whole plans by, is the simulator's
    step (every term, the router's barrier and each layer's synchronizations included) on every
    mode's plan, halo and redistributed ones too, exchanges pipelined or not: the solvers plan the
    step the simulator charges."""
    cluster = data.draw(clusters(max_nodes=4))
    samples = data.draw(batches(cluster, fill=0.6))
    cost = data.draw(costs(pipelined=True)).for_cluster(cluster)
    est = PlanEstimate({s.id: s.length for s in samples}, cluster, cost)
    for mode in MODE_TABLE:
        if mode.needs_reach and cost.sparse.first_key is None:
            continue
        plan = make_plan(samples, cluster, cost, mode.name)
        assert est.step_time(plan.parents) == pytest.approx(simulate(plan, cost).step_time, rel=REL), mode.name


@settings(max_examples=25, deadline=None)  # a few modes planned per example
@given(st.data())
def test_a_step_priced_from_parents_kept_from_other_plans_is_priced_as_alone(data):
    """PlanEstimate keeps each parent's stretch ends the first time a step holds it; a plan that
    shares parents with plans priced before (the same objects, as the planner's stages hand them
    on) is priced exactly as a fresh estimate prices it alone: its repacked parents redistributed,
    its wide parents in their own layout, another mode's plan of the same step, in turn."""
    cluster = data.draw(clusters(max_nodes=4))
    samples = data.draw(batches(cluster, fill=0.6))
    cost = data.draw(costs(pipelined=True)).for_cluster(cluster)
    length_of = {s.id: s.length for s in samples}
    node = cluster.gpus_per_node
    first = make_plan(samples, cluster, cost, data.draw(st.sampled_from(["repack", "repack+solver", "repack+widths"]))).parents
    plans = [
        first,
        tuple(replace(p, redistributed=True) if p.repacked else p for p in first),
        tuple(ParentPlan(p.group, (p.group,), "its own layout") if p.group.size > node else p for p in first),
        make_plan(samples, cluster, cost, "baseline").parents,
        first,
    ]
    shared = PlanEstimate(length_of, cluster, cost)
    for k in data.draw(st.permutations(range(len(plans)))):
        alone = PlanEstimate(length_of, cluster, cost).step_time(list(plans[k]))
        assert shared.step_time(list(plans[k])) == alone, k  # the same sums in the same order


@settings(max_examples=25, deadline=None)  # several modes planned and simulated per example
@given(st.data())
def test_the_floor_is_below_every_step_of_the_assigned_parents(data):
    """PlanEstimate.floor_time of the assigned parents (the baseline's plan) is at most the
    simulated step of every plan that keeps them and runs the wide ones' sparse layers another
    way: each mode without the parent solver (Ulysses children, halo children, halo attention in
    the parent's own layout), repack's children redistributed rather than folded, and repack's
    children each run as Ulysses or as halo at random; choose leaves those modes unplanned where
    the floor lies above a faster plan's step."""
    cluster = data.draw(clusters(max_nodes=4))
    samples = data.draw(batches(cluster, fill=0.6))
    cost = data.draw(costs(pipelined=True)).for_cluster(cluster)
    length_of = {s.id: s.length for s in samples}
    floor = PlanEstimate(length_of, cluster, cost).floor_time(make_plan(samples, cluster, cost, "baseline").parents)
    reach = cost.sparse.first_key is not None
    plans = [make_plan(samples, cluster, cost, m.name) for m in MODE_TABLE if not m.solver and (reach or not m.needs_reach)]
    repack = make_plan(samples, cluster, cost, "repack")
    moved = tuple(replace(p, redistributed=True) if p.repacked else p for p in repack.parents)
    plans.append(StepPlan(cluster, repack.lengths, moved, "redistribute").validate())
    if reach:

        def either(c):  # a child as Ulysses or, drawn, as halo
            return passing_way(replace(c, way=Way.HALO), length_of, cost) if c.size > 1 and data.draw(st.booleans()) else c

        mixed = tuple(replace(p, children=tuple(map(either, p.children))) if p.repacked else p for p in repack.parents)
        plans.append(StepPlan(cluster, repack.lengths, mixed, "choose").validate())
    for plan in plans:
        assert floor <= simulate(plan, cost).step_time * (1 + REL), plan.label


@given(parents(), st.data())
def test_the_joint_fill_prices_a_bin_and_places_a_sample_as_the_reference(case, data):
    """Two parents: the case's (wide with children, or node-local) and one of half its width in its
    own layout on the other half of the cluster (a sample's full attention weighs differently on
    the two); the first samples go where the plan has them, the rest by place(),
    which must pick the bin where the sample finishes earliest."""
    cluster, cost, plan, length_of = case
    n = len(length_of)
    lengths = np.array([length_of[i] for i in range(n)])
    fill = _BinFill(cluster, cost, cost.tokenwise_cost(lengths), cost.full_cost(lengths), lengths)
    g = plan.group
    other = Group(cluster.world_size // 2 - g.start, max(1, g.size // 2), ())
    bins = {0: fill.add_parent(g.size, [c.size for c in plan.children] if plan.repacked else None), 1: fill.add_parent(other.size, None)}
    layouts = {0: (g, plan.children), 1: (other, (other,))}
    for i in range(data.draw(st.integers(0, n // 2))):  # at least half the samples go through place()
        fill.add(bins[0][next(k for k, c in enumerate(plan.children) if i in c.samples)], i)

    def bin_time(b: int, extra: tuple[int, ...] = ()) -> float:
        """The reference's time of bin b (its parent's shared part and the child it is), with `extra` samples added."""
        p = fill.bin_parent[b]
        parent, children = layouts[p]
        parent = Group(parent.start, parent.size, fill.members(np.arange(n))[p] + extra)
        child = children[bins[p].index(b)]
        child = parent if child.size == parent.size else Group(child.start, child.size, fill.members(np.arange(n), of_bins=True)[b] + extra)
        return ref.shared_time(parent, length_of, cost) + ref.child_time(child, parent, length_of, cost)

    every = bins[0] + bins[1]
    for b in every:
        assert fill.time(b) == pytest.approx(bin_time(b), rel=REL)
    budget = cluster.tokens_per_rank
    for i in range(len(fill.placed_items), n):
        room = [
            b
            for b in every
            if fill.bin_rank_tokens[b] - (-length_of[i] // fill.bin_size[b]) <= budget
            and fill.parent_rank_tokens[fill.bin_parent[b]] - (-length_of[i] // fill.parent_size[fill.bin_parent[b]]) <= budget
        ]
        best = min((bin_time(b, (i,)) for b in room), default=None)
        b = fill.place(i)
        if best is None:
            assert b == -1
            continue
        assert bin_time(b) == pytest.approx(best, rel=REL), "the fill put the sample where it does not finish earliest"
        assert fill.time(b) == pytest.approx(bin_time(b), rel=REL)


@given(parents(), st.data())
def test_the_rebalance_prices_trial_moves_as_the_reference(case, data):
    cluster, cost, plan, length_of = case
    g = plan.group
    if not plan.repacked:
        return  # trial moves of children: a wide parent's
    n = len(length_of)
    outside = n  # one more sample, not in the parent, to move in
    length_of = {**length_of, outside: data.draw(st.integers(1, cluster.tokens_per_rank))}
    prices = _StepPrices(length_of, cluster, cost, repack=True)
    kids = tuple((c.size, c.samples) for c in plan.children)
    state = _GroupState(g, list(g.samples), prices, kids)

    def priced(members) -> float:
        """The reference's time of the parent with its children holding `members` (a list per child)."""
        children = tuple(Group(c.start, c.size, tuple(m)) for c, m in zip(plan.children, members))
        return ref.best_layout_time(Group(g.start, g.size, tuple(s for m in members for s in m)), children, length_of, cost)

    assert state.time == pytest.approx(priced([c.samples for c in plan.children]), rel=REL)
    a = data.draw(st.sampled_from(g.samples))
    out = state.removing(a)
    assert state.price(out) == pytest.approx(priced([k.members for k in out.kids]), rel=REL)
    into = state.adding(outside)
    if into is None:  # over the parent's budget
        return
    parent = Group(g.start, g.size, g.samples + (outside,))
    if into.kids is None:  # no child has room for it: the parent's own layout
        assert state.price(into) == pytest.approx(ref.parent_time(ParentPlan(parent, (parent,)), length_of, cost), rel=REL)
        return
    assert state.price(into) == pytest.approx(priced([k.members for k in into.kids]), rel=REL)
    # it joined the child where it finishes earliest
    chosen = next(k for k, kid in enumerate(into.kids) if outside in kid.members)
    times = [ref.child_time(Group(c.start, c.size, c.samples + (outside,)), parent, length_of, cost) for c in plan.children]
    fits = [
        k for k, c in enumerate(plan.children) if sum(-(-length_of[s] // c.size) for s in c.samples + (outside,)) <= cluster.tokens_per_rank
    ]
    assert times[chosen] == pytest.approx(min(times[k] for k in fits), rel=REL)


@given(parents())
def test_the_child_problem_prices_a_child_as_the_reference(case):
    cluster, cost, plan, length_of = case
    g = plan.group
    p = child_problem([], g.size, cluster, cost)
    for c in plan.children:
        if c.size > cluster.gpus_per_node:
            continue  # the child problem's children are node-local
        linear = sum(float(cost.tokenwise_cost(length_of[s])) for s in c.samples)
        tokens = sum(length_of[s] for s in c.samples)
        assert p.child_time(c.size, linear, tokens) == pytest.approx(ref.child_time(c, g, length_of, cost), rel=REL)


@given(st.data())
def test_the_least_loaded_fill_finds_the_bin_a_scan_of_every_bin_finds(data):
    """solver.fill against its definition, a scan of every bin: after any sequence of placements
    (a bin's load grows, its room shrinks, a sibling's load grows with it as a parent's does),
    least_loaded(shape, n) is the smallest (load, bin) among the shape's bins with room >= n, or
    -1; with the samples in any order, longest first or not."""
    from solver.fill import LeastLoaded

    n_bins = data.draw(st.integers(1, 12))
    shape_of = [data.draw(st.sampled_from("ab")) for _ in range(n_bins)]
    load = [float(data.draw(st.integers(0, 5))) for _ in range(n_bins)]
    room = [data.draw(st.integers(0, 40)) for _ in range(n_bins)]
    fill = LeastLoaded(load.__getitem__, room.__getitem__)
    for b, s in enumerate(shape_of):
        fill.add(s, b)
    for _ in range(data.draw(st.integers(1, 40))):
        shape, n = data.draw(st.sampled_from(sorted(fill.shapes()))), data.draw(st.integers(1, 40))
        fits = [(load[b], b) for b in range(n_bins) if shape_of[b] == shape and room[b] >= n]
        got = fill.least_loaded(shape, n)
        assert got == (min(fits)[1] if fits else -1), (shape, n, load, room)
        if got >= 0:  # the sample joins it; a sibling (the same parent) may grow and shrink with it
            for b in {got, data.draw(st.integers(0, n_bins - 1))}:
                load[b] += data.draw(st.integers(0, 3))
                room[b] = max(0, room[b] - data.draw(st.integers(0, n)))


def test_the_estimate_refuses_halo_children_which_the_halo_pricing_prices():
    """PlanEstimate prices Ulysses children; a halo plan's parent is refused by name (it once got a
    Ulysses child's price without a word), and solver.reference.parent_time prices it."""
    from solver import samples_from_lengths

    cluster = Cluster(16, 4, 256)
    cost = CostModel(ModelConfig.from_name("tiny"), HardwareConfig()).for_cluster(cluster)
    samples = samples_from_lengths([900, 500, 300, 120, 60, 40, 30, 25, 20, 10, 9, 8])
    plan = make_plan(samples, cluster, cost, "halo")
    halo = next(p for p in plan.parents if p.halo)
    est = PlanEstimate(plan.length_of, cluster, cost)
    with pytest.raises(ValueError, match=f"the parent at rank {halo.group.start} has halo children: price it with solver.reference"):
        est.parent_times(plan.parents)
    with pytest.raises(ValueError, match="has halo children"):
        est.parent_time(halo)
    assert ref.parent_time(halo, plan.length_of, cost) > 0


@given(st.lists(parents(), min_size=1, max_size=4))
def test_the_rebalance_prices_every_own_layout_parent_at_once_as_the_reference(cases):
    """_OwnLayouts prices all of a step's parents in their own layout with numpy (the rebalance
    reads only the slowest and the fastest one by one): each time is the reference's, and the very
    float a _GroupState of that parent computes alone, and each parent's members come sorted
    longest first, then by id."""
    cluster, cost, _, _ = cases[0]
    length_of, groups = {}, []
    for k, (_, _, plan, lengths) in enumerate(cases):  # the parents side by side, their samples renumbered
        ids = {s: len(length_of) + s for s in lengths}
        length_of.update({ids[s]: n for s, n in lengths.items()})
        groups.append(Group(k * plan.group.size, plan.group.size, tuple(ids[s] for s in reversed(plan.group.samples))))
    node = cluster.gpus_per_node
    cluster = Cluster(-(-sum(g.size for g in groups) // node) * node, node, max(cluster.tokens_per_rank, max(length_of.values())))
    cost = cost.for_cluster(cluster)
    prices = _StepPrices(length_of, cluster, cost, repack=False)
    layouts = prices.own_layouts([g.samples for g in groups], [g.size for g in groups])
    times = layouts.times(cost)
    for j, g in enumerate(groups):
        assert layouts.members(j) == sorted(g.samples, key=lambda s: (-length_of[s], s))
        assert times[j] == pytest.approx(ref.parent_time(ParentPlan(g, (g,)), length_of, cost), rel=REL)
        assert times[j] == _GroupState(g, list(g.samples), prices).time  # the same float, not just close


@given(parents(), st.floats(0.0, 2.0))
def test_a_parent_priced_under_a_bound_is_exact_below_it_and_a_lower_bound_above(case, scale):
    """reference.parent_time(..., below): where the parent's time is under `below`, exactly that
    time; where not, a time at least `below` and at most the parent's (what lets the per-parent
    choice stop pricing a candidate that cannot win), for Ulysses children, the own layout and,
    where the kind has a reach, halo attention over the whole parent."""
    cluster, cost, plan, length_of = case
    plans = [plan, ParentPlan(plan.group, (plan.group,), NODE_LOCAL)]
    if cost.sparse.first_key is not None:
        plans.append(own_layout_halo(plan.group, length_of, cost))
    for pp in plans:
        full = ref.parent_time(pp, length_of, cost)
        below = full * scale
        t = ref.parent_time(pp, length_of, cost, below)
        if full < below:
            assert t == full
        else:
            assert below <= t <= full


def test_the_halo_solver_bounded_by_the_best_so_far_picks_what_it_picks_unbounded():
    """solve_halo_children(bounded=True), which prices each target's children only until they
    reach the best so far or the own layout (choose_children's call), returns the children the
    solver returns pricing every candidate in full: on every wide parent of the assigned parents
    of random steps with long samples, at 64 and 256 ranks, for two models with a reach."""
    from solver import samples_from_lengths  # noqa: PLC0415
    from solver.assignment import assign_parents  # noqa: PLC0415

    checked, halo = 0, 0
    for model, node, longest in (("paper", 8, 400_000), ("tiny", 4, 200_000)):  # tiny's 8 heads: at most SP8
        for seed, w in enumerate((64, 256, 64, 256)):
            rng = np.random.default_rng(seed)
            cluster = Cluster(w, node, 32768)
            cost = CostModel(ModelConfig.from_name(model), HardwareConfig()).for_cluster(cluster)
            lengths = [int(n) for n in rng.integers(40_000, longest, w // 16)]
            while sum(lengths) < 0.7 * w * 32768:
                lengths.append(min(int(rng.lognormal(8.5, 1.3)) + 16, longest))
            samples = samples_from_lengths(lengths)
            length_of = dict(enumerate(lengths))
            for g in assign_parents(samples, cluster, cost):
                if g.size <= cluster.gpus_per_node:
                    continue
                full = solve_halo_children(g, length_of, cluster, cost)
                bounded = solve_halo_children(g, length_of, cluster, cost, bounded=True)
                assert bounded[0] == full[0], (model, w, g.start)
                checked += 1
                halo += full[0] != (g,)
    assert checked >= 20 and 0 < halo < checked, (checked, halo)  # both answers occur


def test_a_redistributing_parents_step_is_the_simulators_where_its_ranks_busiest_layouts_differ():
    """A redistributing parent's full layers hold the parent's token layout and its sparse layers
    the children's, so the rank with the most tokens in one need not be the one in the other, and
    nothing synchronizes the ranks between a full layer's experts and the next layer's token-wise
    work: the estimate prices such a parent's ranks one by one, as the simulator does (here rank 2
    holds 13 parent-layout tokens to rank 3's 12, and 24 child-layout tokens to its 25; pricing
    the child's busiest rank in each layout overstated the step by 3.5e-11 s)."""
    cluster = Cluster(12, 4, 64)
    samples = samples_from_lengths([63, 97, 3])
    hw = HardwareConfig(
        ratio_reading="group", inter_intra_ratio=3.5, a2a_latency=0.0, a2a_inter_latency=0.0, a2a_peer_latency=0.0,
        attention_sample_latency=2e-4,
    )  # fmt: skip
    cost = CostModel(ModelConfig.from_name("tiny"), hw, costs=CostsConfig(recompute="full", router_sync=False)).for_cluster(cluster)
    plan = make_plan(samples, cluster, cost, "redistribute")
    assert any(p.redistributed for p in plan.parents)
    est = PlanEstimate({s.id: s.length for s in samples}, cluster, cost)
    assert est.step_time(plan.parents) == pytest.approx(simulate(plan, cost).step_time, rel=REL)
