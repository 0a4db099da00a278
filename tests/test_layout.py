"""Layouts and exchange plans: every token placed once, plans consistent, round trips identities."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config import Cluster, HardwareConfig, ModelConfig, SettingError
from solver import (
    CostModel,
    Group,
    PlanError,
    StepPlan,
    TokenLayout,
    Way,
    head_to_token_plan,
    head_to_token_rank,
    head_token_ids,
    make_plan,
    samples_from_lengths,
    simulate_exchange,
    token_ids,
    token_to_head_plan,
    token_to_head_rank,
)
from solver.layout import chunk_bounds
from solver.modes import MODES
from tests.strategies import batches, clusters

COST = CostModel(ModelConfig.from_name("tiny"), HardwareConfig())


def all_tokens(lengths):
    return np.sort(np.concatenate([(np.int64(s) << 32) + np.arange(n, dtype=np.int64) for s, n in lengths.items()]))


def check_token_layout(layout: TokenLayout, ranks):
    got = np.sort(np.concatenate([token_ids(layout, r) for r in ranks]))
    np.testing.assert_array_equal(got, all_tokens(layout.lengths))


@st.composite
def planned(draw):
    cluster = draw(clusters())
    samples = draw(batches(cluster))
    mode = draw(st.sampled_from(MODES))
    return make_plan(samples, cluster, COST, mode)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planned())
def test_layouts_place_every_token_once(plan: StepPlan):
    ranks = range(plan.cluster.world_size)
    placed = sorted(s for p in plan.parents for s in p.group.samples)
    assert placed == sorted(plan.length_of)
    check_token_layout(plan.parent_layout, ranks)
    check_token_layout(plan.child_layout, ranks)
    heads = np.sort(np.concatenate([head_token_ids(plan.parent_layout, p.group) for p in plan.parents]))
    np.testing.assert_array_equal(heads, all_tokens(plan.length_of))
    g = plan.cluster.gpus_per_node
    for p in plan.parents:
        covered = sorted(r for c in p.children for r in c.ranks)
        assert covered == list(p.group.ranks)
        for c in p.children:
            if c.halo:  # any contiguous range of the parent, across nodes if need be; a rank per token at most
                assert p.group.start <= c.start < c.stop <= p.group.stop
                assert c.size == p.group.size or not c.samples or c.size <= min(plan.length_of[s] for s in c.samples)
                continue
            assert c.start % c.size == 0
            if p.repacked:
                assert c.start // g == (c.stop - 1) // g and c.size <= g
    for layout in (plan.child_layout, plan.parent_layout):
        counts = layout.tokens_per_rank()
        assert counts == {r: len(token_ids(layout, r)) for r in ranks}  # the fast count matches the chunks
        assert max(counts.values()) <= plan.cluster.tokens_per_rank


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planned())
def test_exchange_plans_consistent_and_round_trip(plan: StepPlan):
    parent, child = plan.parent_layout, plan.child_layout
    ranks = range(plan.cluster.world_size)
    entry = token_to_head_plan(child, parent)
    exit_ = head_to_token_plan(parent, child)
    # what rank i sends to j is what j expects from i
    for p in entry.values():
        for j in range(p.group_size):
            peer = entry[p.group_start + j]
            assert p.send_counts[j] == peer.recv_counts[p.peer_index]
        assert sorted(p.unpack_rows.tolist()) == list(range(p.n_out))
    x = {r: token_ids(child, r) for r in ranks}
    heads = simulate_exchange(entry, x)
    by_rank = parent.group_of_rank()
    for r in ranks:
        np.testing.assert_array_equal(heads[r], head_token_ids(parent, by_rank[r]))
    back = simulate_exchange(exit_, heads)
    for r in ranks:
        np.testing.assert_array_equal(back[r], x[r])
    # one rank's exchanges, built from its group alone (what a running rank does), are the same
    for r in ranks:
        mine, theirs = token_to_head_rank(child, parent, r), entry[r]
        back_mine, back_theirs = head_to_token_rank(parent, child, r), exit_[r]
        for a, b in ((mine, theirs), (back_mine, back_theirs)):
            assert (a.to_heads, a.group_start, a.group_size, a.n_in, a.n_out) == (b.to_heads, b.group_start, b.group_size, b.n_in, b.n_out)
            for f in ("send_counts", "recv_counts", "pack_rows", "unpack_rows"):
                np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    # inverse of the inverse is the plan itself
    for p in entry.values():
        q = p.inverse().inverse()
        np.testing.assert_array_equal(q.pack_rows, p.pack_rows)
        np.testing.assert_array_equal(q.unpack_rows, p.unpack_rows)


def test_exit_repacks_into_child_layout():
    cluster = Cluster(8, 2, 64)
    lengths = {0: 100, 1: 30, 2: 7, 3: 1}
    parent = TokenLayout((Group(0, 8, (0, 1, 2, 3)),), lengths)
    child = TokenLayout((Group(0, 2, (0,)), Group(2, 1, (1,)), Group(3, 1, (2,)), Group(4, 4, (3,))), lengths)
    parent.validate(cluster)
    child.validate(cluster)
    heads = {r: head_token_ids(parent, parent.groups[0]) for r in range(8)}
    out = simulate_exchange(head_to_token_plan(parent, child), heads)
    for r in range(8):
        np.testing.assert_array_equal(out[r], token_ids(child, r))
    assert [len(out[r]) for r in range(4, 8)] == [0, 0, 0, 1]  # 1 token over 4 ranks: peers with nothing


def test_chunks_are_contiguous_and_uneven_without_padding():
    b = chunk_bounds(97, 8)
    assert b[0] == 0 and b[-1] == 97
    assert set(np.diff(b)) <= {12, 13}


def test_plan_json_round_trip_and_stable_hash():
    samples = samples_from_lengths([300, 40, 17, 1, 63])
    plan = make_plan(samples, Cluster(8, 2, 128), COST, "repack")
    again = StepPlan.from_json(plan.dumps())
    assert again == plan and again.hash == plan.hash
    other = make_plan(samples_from_lengths([300, 40, 17, 1, 64]), Cluster(8, 2, 128), COST, "repack")
    assert other.hash != plan.hash
    with pytest.raises(AttributeError):  # plans are immutable
        plan.label = "baseline"
    # a halo child, and a linear kind's halo child that passes its states by the chain, round trip too
    gdn = CostModel(ModelConfig.from_name("tiny-gdn"), HardwareConfig())
    halo = make_plan(samples_from_lengths([900, 40]), Cluster(8, 2, 128), gdn, "parent+halo")
    chained = replace(
        halo,
        parents=tuple(replace(p, children=tuple(replace(c, way=Way.CHAIN if c.halo else c.way) for c in p.children)) for p in halo.parents),
    )
    for plan in (halo, chained.validate()):
        assert StepPlan.from_json(plan.dumps()) == plan
    assert '"halo"' in halo.dumps() and '"halo:chain"' in chained.dumps() and chained.hash != halo.hash
    with pytest.raises(PlanError, match="a group's fourth item may only be 'halo' or 'halo:chain'"):
        Group.from_json([0, 2, [0], "chain"])  # a way no plan writes


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            dict(world_size=12, gpus_per_node=8),
            r"cluster.world_size \(--world-size\)=12 is not a multiple of cluster.gpus_per_node \(--gpus-per-node\)=8",
        ),
        (dict(world_size=12, gpus_per_node=3), r"cluster.gpus_per_node=3 is invalid: it must be a power of two"),
        (dict(world_size=0, gpus_per_node=8), r"cluster.world_size=0 is invalid: it must be an integer in \[1, 131072\]"),
        (dict(world_size=8, gpus_per_node=8, tokens_per_rank=-1), r"cluster.tokens_per_rank=-1 is invalid"),
    ],
)
def test_bad_cluster_errors_name_the_value(bad, match):
    with pytest.raises(SettingError, match=match):
        Cluster(**bad)


def test_bad_layout_errors():
    cluster = Cluster(8, 2, 64)
    with pytest.raises(PlanError, match="must start at a multiple of 4"):
        TokenLayout((Group(2, 4, (0,)), Group(0, 2, ()), Group(6, 2, ())), {0: 10}).validate(cluster)
    with pytest.raises(PlanError, match="placed twice"):
        TokenLayout((Group(0, 4, (0,)), Group(4, 4, (0,))), {0: 10}).validate(cluster)
    with pytest.raises(PlanError, match="over tokens_per_rank=64"):
        TokenLayout((Group(0, 8, (0,)),), {0: 8 * 64 + 1}).validate(cluster)
    with pytest.raises(PlanError, match="must cover each"):
        TokenLayout((Group(0, 4, (0,)),), {0: 10}).validate(cluster)


# ----- halo groups: the rows each rank receives, against the sparse kinds' masks ---------------------
# which keys a query at position i of its sample sees, written from the kinds' definitions
# (docs/design.md), not from their first_key
KIND_MASKS = {
    "sliding_window": lambda i, j, p: (j <= i) & (i - j < p["window"]),
    "chunked": lambda i, j, p: (j <= i) & (i // p["chunk"] == j // p["chunk"]),
}


@st.composite
def halo_cases(draw):
    """(layout, group, kind, params) of one halo group over a few samples, in ids' order or not."""
    size, start = draw(st.integers(2, 12)), draw(st.integers(0, 5))
    lengths = draw(st.lists(st.one_of(st.sampled_from([1, 2, 7]), st.integers(1, 400)), min_size=1, max_size=5))
    kind, reach = draw(st.sampled_from(sorted(KIND_MASKS))), draw(st.sampled_from([1, 2, 5, 33, 128]))
    ids = tuple(range(len(lengths)))
    group = Group(start, size, ids[::-1] if draw(st.booleans()) else ids, Way.HALO)
    return TokenLayout((group,), dict(enumerate(lengths))), group, kind, {"window": reach} if kind == "sliding_window" else {"chunk": reach}


@settings(max_examples=60, deadline=None)
@given(halo_cases())
def test_halo_rows_are_the_keys_each_rank_sees_on_other_ranks(case):
    from solver.cost import sparse_cost  # noqa: PLC0415
    from solver.layout import halo_pair_rows, halo_transfers  # noqa: PLC0415

    layout, group, kind, params = case
    owner = {(s, t): r for r in group.ranks for s, a, b in layout.local_chunks(r) for t in range(a, b)}
    want: dict[tuple[int, int], int] = {}
    for r in group.ranks:
        for s, a, b in layout.local_chunks(r):
            if a == b:
                continue
            keys = np.arange(b)
            seen = KIND_MASKS[kind](np.arange(a, b)[:, None], keys[None, :], params).any(axis=0)
            for j in keys[seen].tolist():
                if owner[(s, j)] != r:
                    want[(owner[(s, j)], r)] = want.get((owner[(s, j)], r), 0) + 1
    first_key = sparse_cost(kind).first_key
    assert halo_pair_rows(layout, group, first_key, params) == want  # what the simulator prices
    import solver.layout  # noqa: PLC0415

    block, solver.layout.HALO_ROWS_BLOCK = solver.layout.HALO_ROWS_BLOCK, 1  # one sample a block: the blocks add up
    try:
        assert halo_pair_rows(layout, group, first_key, params) == want
    finally:
        solver.layout.HALO_ROWS_BLOCK = block
    moved: dict[tuple[int, int], int] = {}
    for t in halo_transfers(layout, group, first_key, params):  # what the runtime moves
        assert t.src < t.dst and all(owner[(t.sample, x)] == t.src for x in (t.lo, t.hi - 1))
        moved[(t.src, t.dst)] = moved.get((t.src, t.dst), 0) + t.hi - t.lo
    assert moved == want


@settings(max_examples=40, deadline=None)
@given(halo_cases())
def test_a_ranks_own_halo_transfers_are_its_share_of_the_groups_in_the_same_order(case):
    from solver.cost import sparse_cost  # noqa: PLC0415
    from solver.layout import halo_transfers  # noqa: PLC0415

    layout, group, kind, params = case
    first_key = sparse_cost(kind).first_key
    every = halo_transfers(layout, group, first_key, params)
    for r in group.ranks:  # what the runtime builds for one rank, against the whole group's list
        assert halo_transfers(layout, group, first_key, params, r) == [t for t in every if r in (t.src, t.dst)], r
