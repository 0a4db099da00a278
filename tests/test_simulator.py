"""Simulator on hand-computed cases, and the ablation command end to end on a short run."""

import json
import os
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import experiments.ablation.__main__ as ablation
from config import Cluster, CostsConfig, HardwareConfig, ModelConfig, SettingError
from experiments.common.ablation import anchor_load_ratio
from experiments.common.results import read_run
from solver import CostModel, Group, Way, make_plan, samples_from_lengths
from solver.estimate import PlanEstimate
from solver.modes import MODE_TABLE, MODES
from solver.plan import NODE_LOCAL, ParentPlan, StepPlan
from solver.reference import parent_time
from solver.simulator import simulate, sparse_layer_bytes
from solver.sites import Family
from solver.timeline import Groups, Timeline

HALO_MODES = tuple(m.name for m in MODE_TABLE if m.needs_reach or m.cheapest)  # the modes whose plans may hold halo children

PAPER = CostModel(ModelConfig.from_name("paper"), HardwareConfig())


BARE = CostModel(ModelConfig.from_name("paper"), HardwareConfig(), costs=CostsConfig.from_name("bare"))


def test_single_rank_step_is_the_sum_of_its_layer_costs():
    lens = np.array([5000, 1200, 7], dtype=float)
    plan = make_plan(samples_from_lengths([5000, 1200, 7]), Cluster(1, 1, 32768), PAPER, "baseline")
    m = PAPER.model
    attention = m.n_full * PAPER.full_attn_time(lens).sum() + m.n_sparse * PAPER.sparse_attn_time(lens).sum()
    layers, head = lens.sum() * m.n_layers * PAPER.layer_token_time, lens.sum() * PAPER.head_token_time
    # the bare accounting: forward + backward = 3 forwards
    r = simulate(plan, BARE)
    assert r.step_time == pytest.approx(3.0 * (layers + head + attention), rel=1e-9)
    assert r.intra_comm == r.inter_comm == r.imbalance_wait == r.moe_comm == r.grad_sync == r.optimizer == 0
    # the complete one: full recompute (layers and attention 4 forwards, the LM head 3), no
    # experts' all-to-all (the default EP degree is a node's ranks: one here), the optimizer over
    # all parameters (one rank)
    r = simulate(plan, PAPER)
    assert r.moe_comm == 0 and r.step_time == pytest.approx(r.compute + r.optimizer, rel=1e-9)
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    params = m.n_layers * (m.hidden * (q + 2 * kv) + q * m.hidden + m.hidden * m.n_experts + m.n_experts * 3 * m.hidden * m.expert_ffn)
    params += 2 * m.vocab * m.hidden  # embedding and LM head
    assert r.compute == pytest.approx(4.0 * (layers + attention) + 3.0 * head, rel=1e-9)
    assert r.optimizer == pytest.approx(params * 30 / 3.35e12, rel=1e-9)
    # with an EP8 group across 8 nodes of one rank: a rank's tokens' top-8 copies of the hidden
    # state out and back, 7/8 of them off the rank, at the inter-node rate (7x below 150 GB/s), 3
    # passes, 20% exposed; and per layer 8 calls' latency (3 forward, again under recompute, 2 backward)
    cluster = Cluster(8, 1, 32768)
    plan = make_plan(samples_from_lengths([5000, 1200, 7]), cluster, PAPER, "baseline")
    r = simulate(plan, CostModel(m, HardwareConfig(), costs=CostsConfig(ep_placement="inter", ep_degree=8)))
    per_token = 0.2 * 3 * 2 * m.top_k * m.hidden * 2 * 7 / 8 / (150e9 / 7)
    moe = lens.sum() / 8 * m.n_layers * per_token + m.n_layers * 8 * 25e-6  # the mean over the 8 ranks
    assert r.moe_comm == pytest.approx(moe, rel=1e-9)
    assert r.moe_intra_bytes == 0 and r.moe_inter_bytes == pytest.approx(lens.sum() * m.n_layers * 3 * 2 * m.top_k * m.hidden * 2 * 7 / 8)
    parts = r.compute + r.intra_comm + r.inter_comm + r.moe_comm + r.imbalance_wait + r.grad_sync + r.optimizer
    assert r.step_time == pytest.approx(parts, rel=1e-9)
    with pytest.raises(SettingError, match=r"costs.ep_degree \(--ep\)=8 does not divide the cluster's 1 ranks"):
        simulate(
            make_plan(samples_from_lengths([5000]), Cluster(1, 1, 32768), PAPER, "baseline"),
            CostModel(m, HardwareConfig(), costs=CostsConfig(ep_placement="inter", ep_degree=8)),
        )


def test_breakdown_adds_up_and_lower_bound_holds():
    cluster = Cluster(32, 8, 32768)
    rng = np.random.default_rng(1)
    lengths = [110_000] + list(rng.integers(200, 9000, 90))
    for mode in MODES:
        r = simulate(make_plan(samples_from_lengths(lengths), cluster, PAPER, mode), PAPER)
        parts = r.compute + r.intra_comm + r.inter_comm + r.moe_comm + r.grad_sync + r.optimizer + r.imbalance_wait
        assert parts == pytest.approx(r.step_time, rel=1e-9)
        assert r.moe_comm > 0 and r.grad_sync > 0 and r.optimizer > 0
        assert r.lower_bound <= r.step_time
        assert 0 < r.mfu < 1


def hand_plan(repack: bool) -> StepPlan:
    """A 16-rank parent over two nodes of 8 holding four samples; children are node-local."""
    cluster = Cluster(16, 8, 32768)
    lengths = ((0, 60_000), (1, 20_000), (2, 20_000), (3, 20_000))
    parent = Group(0, 16, (0, 1, 2, 3))
    kids = (Group(0, 8, (0,)), Group(8, 4, (1,)), Group(12, 2, (2,)), Group(14, 2, (3,)))
    pp = ParentPlan(parent, kids if repack else (parent,), "" if repack else "repacking disabled (baseline)")
    return StepPlan(cluster, lengths, (pp,), "repack" if repack else "baseline").validate()


def test_node_local_children_send_no_inter_node_bytes_in_sparse_layers():
    r = simulate(hand_plan(True), PAPER)
    assert r.sparse_inter_bytes == 0 and r.sparse_intra_bytes > 0
    b = simulate(hand_plan(False), PAPER)
    assert b.sparse_inter_bytes > 0


def test_baseline_and_repack_move_the_same_bytes_at_full_attention():
    b, r = simulate(hand_plan(False), PAPER), simulate(hand_plan(True), PAPER)
    assert b.full_intra_bytes + b.full_inter_bytes == pytest.approx(r.full_intra_bytes + r.full_inter_bytes, rel=1e-12)
    # entry and exit, forward, recompute and backward
    assert b.a2a_calls_full == r.a2a_calls_full == 2 * PAPER.exchange_passes * PAPER.model.n_full == 2 * 3 * 12


def test_node_local_plan_matches_across_modes():
    plan = make_plan(samples_from_lengths([3000] * 20), Cluster(16, 8, 32768), PAPER, "repack")
    assert all(p.reason == NODE_LOCAL for p in plan.parents)
    base = make_plan(samples_from_lengths([3000] * 20), Cluster(16, 8, 32768), PAPER, "baseline")
    assert simulate(plan, PAPER).step_time == pytest.approx(simulate(base, PAPER).step_time)


def test_ablation_end_to_end_short_run(tmp_path, capsys):
    out = tmp_path / "abl"
    rows, summary = ablation.main(["--steps", "30", "--seeds", "2", "--out", str(out), "--no-progress", "--no-whole-run"])
    text = capsys.readouterr().out
    assert "the paper" in text and "-5.95" in text and "-7.61" in text and "baseline+solver" in text
    assert "MFU pp (non-causal)" in text and "experts' a2a" in text and "SP8/SP16" in text
    # the calls' fixed costs it prices with, printed: the default's 25 us, a halo call at an all-to-all's
    assert "an all-to-all call 25 us, a halo call 25 us (halo_latency unset" in text
    assert os.path.exists(out / "steps.csv") and os.path.exists(out / "summary.json")
    got_rows, got = read_run(str(out))
    n_selected = sum(len(v) for v in summary["selected_steps"].values())
    assert len(got_rows) == len(rows) == len(MODES) * n_selected > 0
    assert sorted(summary["selected_steps"]) == ["0", "1"] and {r["seed"] for r in got_rows} == {0, 1}
    cfg = got["config"]
    assert got["provenance"]["commit"] and cfg["seeds"] == [0, 1] and cfg["planner"]["assignment_pricing"] == "compute"
    assert cfg["workload"]["fill"] == 0.95 and cfg["costs"]["recompute"] == "full" and cfg["hardware"]["ratio_reading"] == "group"
    over = got["over_seeds"]
    for m in MODES:
        rng = over[m]["time_change_pct"]
        assert rng["min"] <= rng["mean"] <= rng["max"]
    modes = got["modes"]
    assert modes["repack+solver"]["mean_step_time_s"] <= modes["baseline"]["mean_step_time_s"]
    assert modes["repack+widths"]["mean_step_time_s"] <= modes["repack+solver"]["mean_step_time_s"]
    # the selected steps have parents wider than a node, which every mode keeps but the width-choosing
    # solver, free to narrow them (and choose, which starts from its plans)
    assert all(r["widest_parent"] > 8 for r in got_rows if r["mode"] not in ("repack+widths", "choose"))
    fold = got["folding_saving_pct"]  # redistribute's pass against the folding: what the paper avoids costs time
    assert 0 < fold["min"] <= fold["mean"] <= fold["max"] and "saves" in text
    assert all(r["repacked_parents"] == 0 for r in got_rows if r["mode"] in ("baseline", "baseline+solver"))
    # halo attention only where a mode runs it; the naive variant on every wide parent's own layout
    assert all(r["halo_parents"] == 0 for r in got_rows if r["mode"] not in HALO_MODES)
    naive = [r for r in got_rows if r["mode"] == "parent+halo"]
    assert all(r["halo_parents"] == r["wide_parents"] > 0 and r["repacked_parents"] == 0 for r in naive)
    assert all(r["halo_across_parents"] <= r["halo_parents"] for r in got_rows)
    assert "choose: of its" in text
    assert re.search(r"choose against the fastest way without a choice, step by step: no slower on (\d+) of \1 steps", text)
    json.dumps(got)


def test_ablation_rejects_a_malformed_trace(tmp_path):
    bad = tmp_path / "t.csv"
    bad.write_text("step,length\n0,100\n1,abc\n")
    with pytest.raises(SystemExit, match="'abc' is not an integer"):
        ablation.main(["--trace", str(bad), "--out", str(tmp_path / "o"), "--no-progress", "--no-whole-run"])


@pytest.mark.parametrize("gpus_per_node", [2, 4, 8])
def test_the_node_size_is_the_clusters_and_the_estimate_agrees_with_the_simulator(gpus_per_node):
    cost = CostModel(ModelConfig.from_name("paper"), HardwareConfig())
    cluster = Cluster(8, gpus_per_node, 32768)
    bound = cost.for_cluster(cluster)
    assert bound is cost.for_cluster(Cluster(32, gpus_per_node, 1024))  # one bound model per node size
    assert bound.peers(0, 8, 0) == (gpus_per_node - 1, 8 - gpus_per_node)
    # one SP8 parent, its sample split evenly over every rank: no rank waits for another, so the
    # closed-form estimate and the simulated timeline must agree, whichever node size prices it
    samples = samples_from_lengths([8 * 20_000])
    plan = make_plan(samples, cluster, cost, "baseline")
    assert [p.group.size for p in plan.parents] == [8]
    bound = cost.for_cluster(cluster)
    est = PlanEstimate(plan.length_of, cluster, cost).plan_time(plan.parents)
    est += bound.moe_fixed_time() + bound.grad_sync_time(8) + bound.optimizer_time(8)  # what every rank pays alike
    assert simulate(plan, cost).step_time == pytest.approx(est, rel=1e-9)


def test_a_cost_model_without_a_cluster_prices_no_exchange():
    cost = CostModel(ModelConfig.from_name("paper"), HardwareConfig())
    with pytest.raises(ValueError, match=r"use cost.for_cluster\(cluster\)"):
        cost.exchange_line(8)


def test_the_costs_every_mode_pays_cancel_in_the_difference_and_shrink_the_relative_gain():
    plans = {
        m: make_plan(samples_from_lengths([60_000, 20_000, 20_000, 20_000]), Cluster(16, 8, 32768), PAPER, m)
        for m in ("baseline", "repack")
    }
    plans["repack"] = hand_plan(True)
    plans["baseline"] = hand_plan(False)
    without = PAPER.costs.replace(grad_sync=False, optimizer=False)
    lean = CostModel(PAPER.model, PAPER.hw, costs=without)
    full = {m: simulate(p, PAPER) for m, p in plans.items()}
    bare = {m: simulate(p, lean) for m, p in plans.items()}
    # the gradient sync and the optimizer step are the same for every layout: the absolute gain
    # of repacking does not move, its relative gain shrinks
    gain_full = full["baseline"].step_time - full["repack"].step_time
    gain_bare = bare["baseline"].step_time - bare["repack"].step_time
    assert gain_full == pytest.approx(gain_bare, rel=1e-9) and gain_full > 0
    assert gain_full / full["baseline"].step_time < gain_bare / bare["baseline"].step_time
    extra = full["baseline"].grad_sync + full["baseline"].optimizer
    assert extra > 0 and full["baseline"].step_time == pytest.approx(bare["baseline"].step_time + extra, rel=1e-9)


@pytest.mark.parametrize("reading", ["group", "link"])
def test_the_ratio_reading_sets_a_cross_node_group_rate(reading):
    """'group': an all-to-all across nodes runs at 1/ratio of an intra-node one's rate as a whole;
    'link': only the bytes to other nodes pay the ratio."""
    cost = CostModel(PAPER.model, HardwareConfig(ratio_reading=reading, a2a_latency=0.0)).for_cluster(Cluster(32, 8, 1024))
    per_byte = {p: cost.exchange_time(1.0, 0, p, 0, 1.0)[0] + cost.exchange_time(1.0, 0, p, 0, 1.0)[1] for p in (8, 16, 32)}
    rate = {p: (p - 1) / p / per_byte[p] for p in per_byte}  # bytes a rank sends to its peers per second
    if reading == "group":
        assert rate[8] / rate[16] == pytest.approx(7.0) and rate[8] / rate[32] == pytest.approx(7.0)
    else:  # SP16: 7 peers at 1x, 8 at 7x; SP32: 7 at 1x, 24 at 7x
        assert rate[8] / rate[16] == pytest.approx((7 + 8 * 7) / 15) and rate[8] / rate[32] == pytest.approx((7 + 24 * 7) / 31)


@pytest.mark.parametrize("recompute, passes, router", [("full", 4, 5), ("selective", 3, 3), ("none", 3, 3)])
def test_fixed_costs_add_exactly_what_every_rank_pays(recompute, passes, router):
    """A layer's fixed cost is paid by every rank in every pass (forward 1, backward 2, the
    recomputed forward 1 more under full recompute); a collective's latency three times per
    sharded block (two gathers and a reduction), as often per block's experts (a module of their
    own under expert parallelism over more than one replica: EP8 of 32 ranks), twice for the root
    (one gather, one reduction), and once per router all-reduce (forward 2, backward 1, the
    recomputed forward 2 more). Every mode's step grows by exactly that."""
    model = ModelConfig.from_name("paper")
    overhead, latency = 1e-3, 2e-4
    plain = CostModel(model, HardwareConfig(), costs=CostsConfig(recompute=recompute))
    fixed = CostModel(model, HardwareConfig(layer_overhead=overhead, collective_latency=latency), costs=CostsConfig(recompute=recompute))
    lengths = [120_000, 30_000] + [3000] * 60
    for mode in ("baseline", "repack+solver"):
        plan = make_plan(samples_from_lengths(lengths), Cluster(32, 8, 32768), plain, mode)
        a, b = simulate(plan, plain), simulate(plan, fixed)
        sync = (2 + 3 * model.n_layers + 3 * model.n_layers) * latency
        want = model.n_layers * passes * overhead + sync + model.n_layers * router * latency
        assert b.step_time - a.step_time == pytest.approx(want, rel=1e-9)
        assert b.grad_sync - a.grad_sync == pytest.approx(sync, rel=1e-9)


@pytest.mark.parametrize("name", ["paper", "tiny-gdn"])
@pytest.mark.parametrize("recompute, passes", [("full", 4), ("selective", 4), ("none", 3)])
def test_an_attention_call_pays_its_sample_latency_once_per_sample(name, recompute, passes):
    """attention_sample_latency: on one rank every attention call (forward 1, backward 2, the
    forward again under either recompute) pays it once per sample it holds; a linear kind's S
    layers are no attention call and pay none."""
    model, lat, lengths = ModelConfig.from_name(name), 1e-3, [700, 300, 5, 1]
    costs = CostsConfig(recompute=recompute)
    plain = CostModel(model, HardwareConfig(), costs=costs)
    dear = CostModel(model, HardwareConfig(attention_sample_latency=lat), costs=costs)
    plan = make_plan(samples_from_lengths(lengths), Cluster(1, 1, 4096), plain, "baseline")
    layers = model.n_layers if name == "paper" else model.n_full
    want = len(lengths) * layers * passes * lat
    assert simulate(plan, dear).step_time - simulate(plan, plain).step_time == pytest.approx(want, rel=1e-9)


def test_a_halo_childs_ranks_pay_the_sample_latency_for_the_samples_they_hold_a_piece_of():
    """On a halo layout each rank's attention call loops over the samples it holds tokens of, a
    sample shorter than the group on a few ranks only (counted from the layout's own chunks); in
    the full layers' head layout every rank holds every sample. The solvers' step estimate prices
    the same."""
    from solver.layout import TokenLayout
    from solver.simulator import _Layout

    lat, lengths = 1e-3, ((0, 3), (1, 20_000), (2, 5))
    cluster = Cluster(8, 8, 32768)
    group = Group(0, 8, (0, 1, 2))
    child = Group(0, 8, (0, 1, 2), Way.HALO)
    plan = StepPlan(cluster, lengths, (ParentPlan(group, (child,), "halo attention on its own layout"),), "parent+halo").validate()
    dear = CostModel(PAPER.model, PAPER.hw.replace(attention_sample_latency=lat), costs=PAPER.costs)
    layouts = [_Layout(plan.child_layout.groups, 8, plan.length_of, c) for c in (PAPER, dear)]
    held = [len({s for s, a, b in TokenLayout((child,), dict(lengths)).local_chunks(r) if b > a}) for r in range(8)]
    assert min(held) < 3 == max(held)  # the short samples sit on some ranks only
    np.testing.assert_allclose(layouts[1].sparse_attn - layouts[0].sparse_attn, lat * np.array(held), rtol=1e-9)
    heads = [_Layout(plan.parent_layout.groups, 8, plan.length_of, c) for c in (PAPER, dear)]
    np.testing.assert_allclose(heads[1].full_attn - heads[0].full_attn, lat * 3, rtol=1e-9)
    est = PlanEstimate(dict(lengths), cluster, dear.for_cluster(cluster))
    assert est.step_time(plan.parents) == pytest.approx(simulate(plan, dear).step_time, rel=1e-12)


def _two_kinds_plan(long: int, short: int) -> StepPlan:
    """16 ranks: one sample of `long` tokens on an SP8 group, eight of `short` tokens on single ranks."""
    lengths = ((0, long),) + tuple((i + 1, short) for i in range(8))
    groups = (Group(0, 8, (0,)),) + tuple(Group(8 + i, 1, (i + 1,)) for i in range(8))
    return StepPlan(Cluster(16, 8, 32768), lengths, tuple(ParentPlan(g, (g,), NODE_LOCAL) for g in groups), "baseline").validate()


def test_the_routers_world_barrier_makes_imbalance_paid_layer_by_layer():
    off = CostModel(PAPER.model, PAPER.hw, costs=PAPER.costs.replace(router_sync=False))
    # the single ranks are the slowest at every layer: waiting for them layer by layer costs what
    # waiting once at the end costs
    same = _two_kinds_plan(60_000, 20_000)
    assert simulate(same, PAPER).step_time == pytest.approx(simulate(same, off).step_time, rel=1e-12)
    # the SP8 group is the slowest at full attention (120K^2 / 8 against 25K^2), the single ranks at
    # every other layer (25K tokens each against 15K): with a barrier per layer each kind of layer
    # waits for its own slowest rank
    crossed = _two_kinds_plan(120_000, 25_000)
    on, plain = simulate(crossed, PAPER), simulate(crossed, off)
    assert on.step_time > plain.step_time * 1.05 and on.imbalance_wait > plain.imbalance_wait


def test_each_router_all_reduce_costs_one_collective_latency():
    # forward 2 (counts and mass), full recompute's forward 2, backward 1 (the mass's gradient),
    # per MoE layer; a plan of one balanced parent waits for nobody at the barriers
    latency = 1e-3
    hw = PAPER.hw.replace(collective_latency=latency)
    plan = make_plan(samples_from_lengths([16 * 8192]), Cluster(16, 8, 32768), PAPER, "baseline")
    with_sync = simulate(plan, CostModel(PAPER.model, hw, costs=PAPER.costs))
    without = simulate(plan, CostModel(PAPER.model, hw, costs=PAPER.costs.replace(router_sync=False)))
    assert with_sync.step_time - without.step_time == pytest.approx(PAPER.model.n_layers * 5 * latency, rel=1e-9)


def test_a_call_across_nodes_pays_the_inter_latency_and_a_node_local_one_does_not():
    """a2a_inter_latency: each all-to-all whose group spans nodes takes that much longer, for every
    rank of the group; node-local children's calls do not. On the balanced 16-rank parent over two
    nodes the baseline pays it at every call, repack at the full layers' calls only, and each
    site's exchange column moves by exactly its calls' share; the solvers' price of a layer's
    exchanges moves alike."""
    extra = 1e-3
    crossing = CostModel(PAPER.model, PAPER.hw.replace(a2a_inter_latency=extra), costs=PAPER.costs)
    for repack in (False, True):
        plan = hand_plan(repack)
        a, b = simulate(plan, PAPER), simulate(plan, crossing)
        sparse_calls = 0 if repack else b.a2a_calls_sparse
        assert b.step_time - a.step_time == pytest.approx((b.a2a_calls_full + sparse_calls) * extra, rel=1e-9)
        assert b.full_exchange - a.full_exchange == pytest.approx(b.a2a_calls_full * extra, rel=1e-9)
        assert b.sparse_exchange - a.sparse_exchange == pytest.approx(sparse_calls * extra, rel=1e-9)
    per_layer = 2 * PAPER.exchange_passes * extra  # entry and exit, every pass
    wide, local = crossing.for_cluster(Cluster(16, 8, 32768)), PAPER.for_cluster(Cluster(16, 8, 32768))
    assert wide.exchange_line(16)[1] - local.exchange_line(16)[1] == pytest.approx(per_layer, rel=1e-9)
    assert wide.exchange_line(8) == local.exchange_line(8)


def halo_plan(spans: bool) -> StepPlan:
    """One parent holding one sample, its sparse layers by halo exchange on its own layout: 8 ranks
    over two nodes of 4 (`spans`) or 4 ranks inside one node (and 4 idle)."""
    cluster = Cluster(8, 4, 32768)
    size = 8 if spans else 4
    parent = Group(0, size, (0,))
    idle = () if spans else (ParentPlan(Group(4, 4, ()), (Group(4, 4, ()),), NODE_LOCAL),)
    pp = ParentPlan(parent, (Group(0, size, (0,), Way.HALO),), "halo attention on its own layout")
    return StepPlan(cluster, ((0, 20_000 * size),), (pp, *idle), "parent+halo").validate()


@pytest.mark.parametrize("spans", [False, True])
def test_a_halo_call_pays_the_halo_latency_and_the_all_to_alls_do_not(spans):
    """halo_latency: every rank of a halo child pays it once per sparse layer and pass (forward,
    recompute, backward: its halo exchange is one point-to-point call), in place of a2a_latency
    (the sparse sites' column, a mean over ranks, moves by the callers' share); the full layers'
    all-to-alls keep a2a_latency, and what crossing nodes adds is the same for both. Unset, a
    halo call costs a2a_latency (the step is priced exactly as with it set so); the solvers' halo
    line moves by the same amount per layer."""
    plan, base = halo_plan(spans), PAPER.hw.replace(a2a_latency=2e-4, a2a_inter_latency=1e-4)
    unset = simulate(plan, CostModel(PAPER.model, base, costs=PAPER.costs))
    same = simulate(plan, CostModel(PAPER.model, base.replace(halo_latency=2e-4), costs=PAPER.costs))
    assert same.step_time == unset.step_time and same.sparse_exchange == unset.sparse_exchange
    delta = 3e-4
    dearer = CostModel(PAPER.model, base.replace(halo_latency=2e-4 + delta), costs=PAPER.costs)
    got = simulate(plan, dearer)
    halo_calls = PAPER.model.n_sparse * PAPER.exchange_passes
    assert got.step_time - unset.step_time == pytest.approx(halo_calls * delta, rel=1e-9)
    share = 1.0 if spans else 0.5  # the column is a mean over ranks: half of them idle inside one node
    assert got.sparse_exchange - unset.sparse_exchange == pytest.approx(share * halo_calls * delta, rel=1e-9)
    assert got.full_exchange == unset.full_exchange
    halo = next(p for p in plan.parents if p.halo)
    cheap = CostModel(PAPER.model, base, costs=PAPER.costs).for_cluster(plan.cluster)
    moved = parent_time(halo, plan.length_of, dearer.for_cluster(plan.cluster)) - parent_time(halo, plan.length_of, cheap)
    assert moved == pytest.approx(halo_calls * delta, rel=1e-9)


@pytest.mark.parametrize(
    "plan", [hand_plan(False), hand_plan(True), halo_plan(False), halo_plan(True)], ids=["baseline", "repack", "halo", "halo-across"]
)
def test_one_sparse_layers_bytes_per_rank_make_up_the_steps_sparse_bytes(plan):
    """sparse_layer_bytes (the report's busiest-rank table reads it): over every rank, every
    sparse layer and every pass, its bytes are the step's sparse-site bytes, and its bytes to
    other nodes the step's inter-node ones; node-local children send none across."""
    sent, across = sparse_layer_bytes(plan, PAPER)
    r = simulate(plan, PAPER)
    layers = PAPER.model.n_sparse * PAPER.exchange_passes
    assert layers * sent.sum() == pytest.approx(r.sparse_intra_bytes + r.sparse_inter_bytes, rel=1e-12)
    assert layers * across.sum() == pytest.approx(r.sparse_inter_bytes, rel=1e-12, abs=1e-6)
    assert (across <= sent).all() and sent.sum() > 0
    if plan.label == "repack":
        assert across.sum() == 0


def test_a_wide_parent_left_empty_has_no_anchor():
    """A parent solver may leave a group across nodes without samples (53 and 19 tokens on 8 ranks
    of 32: the long one on SP2, ranks 0-3 idle); the anchor load is then the non-empty wide
    parents' (none here), not an error."""
    lengths = ((0, 53), (1, 19))
    idle = (Group(0, 4, ()), Group(4, 2, (0,)), Group(6, 1, (1,)), Group(7, 1, ()))
    plain = "repacking disabled (baseline)"
    plan = StepPlan(Cluster(8, 2, 32), lengths, tuple(ParentPlan(g, (g,), plain) for g in idle), "baseline+solver").validate()
    assert len(plan.wide_parents()) == 1 and anchor_load_ratio(plan) is None
    used = (Group(0, 4, (0,)), Group(4, 2, (1,)), Group(6, 1, ()), Group(7, 1, ()))
    plan = StepPlan(Cluster(8, 2, 32), lengths, tuple(ParentPlan(g, (g,), plain) for g in used), "baseline").validate()
    assert anchor_load_ratio(plan) == pytest.approx((53 / 4) / (72 / 8))


def _block_schedule(start, first, attn, last, blocks, group_of):
    """Event by event, when each unit leaves an attention pipelined in head blocks: per group, its
    first exchange's blocks back to back from when its last unit arrives (each a collective lasting
    its slowest unit's block), each unit's attention block once its exchange block is in and its
    previous attention block done, then the last exchange's blocks, each once the network is free
    and every unit of the group has done that block's attention."""
    out = np.zeros(len(start))
    for grp in np.unique(group_of):
        at = group_of == grp
        f, l_, a = first[at].max(), last[at].max(), attn[at] / blocks
        net = start[at].max()
        in_at = []
        for _ in range(blocks):
            net += f
            in_at.append(net)
        done = np.full(at.sum(), start[at].max())
        finished = []
        for i in range(blocks):
            done = np.maximum(done, in_at[i]) + a
            finished.append(done.max())
        for i in range(blocks):
            net = max(net, finished[i]) + l_
        out[at] = net
    return out


UNIT = st.tuples(st.floats(0, 2), st.floats(0, 1), st.floats(0, 3), st.floats(0, 1))  # arrival, first block, attention, last block


@given(st.integers(1, 9), st.lists(UNIT, min_size=1, max_size=6), st.data())
def test_a_pipelined_attention_lasts_what_its_block_schedule_lasts(blocks, units, data):
    """Timeline.pipelined_exchange's closed form against the schedule played out block by block
    (_block_schedule), for groups of units arriving at different times with different attention
    and exchange times; one block is the unpipelined exchange, attention, exchange."""
    start, first, attn, last = (np.array(x) for x in zip(*units))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(units) - 1), max_size=len(units) - 1)) if len(units) > 1 else [])
    starts = np.array([0, *cuts])
    layout = Groups(starts, np.diff([*starts, len(units)]))
    group_of = np.repeat(np.arange(len(starts)), layout.sizes)
    tl = Timeline(len(units))
    tl.t = start.copy()
    tl.pipelined_exchange(layout, (first, np.zeros_like(first)), attn, (np.zeros_like(last), last), blocks, Family.FULL)
    np.testing.assert_allclose(tl.t, _block_schedule(start, first, attn, last, blocks, group_of), rtol=1e-12, atol=1e-12)
    # the breakdown adds up: every unit's time went to compute, waiting or exchanges
    np.testing.assert_allclose(tl.compute + tl.wait + tl.intra + tl.inter, tl.t - start, rtol=1e-12, atol=1e-12)
    if blocks == 1:
        plain = Timeline(len(units))
        plain.t = start.copy()
        plain.sync_exchange(layout, first, np.zeros_like(first), Family.FULL)
        plain.work(attn)
        plain.sync_exchange(layout, np.zeros_like(last), last, Family.FULL)
        np.testing.assert_allclose(tl.t, plain.t, rtol=1e-12)


def test_pipelined_exchanges_hide_under_attention_and_pay_a_call_per_block():
    """CostsConfig.overlap_blocks on each mode's plan of one step: with calls free, the plan's
    step is faster pipelined than not, the same bytes move, in blocks times the calls; with a
    call's latency, many blocks cost more than a few."""
    lengths = [120_000, 40_000] + [3000 + 97 * i for i in range(60)]
    cluster = Cluster(32, 8, 32768)
    free = HardwareConfig(a2a_latency=0.0)
    planned = CostModel(PAPER.model, free)
    plans = {m: make_plan(samples_from_lengths(lengths), cluster, planned, m) for m in ("baseline", "repack+solver", "halo")}

    def run(mode, blocks, hw):
        return simulate(plans[mode], CostModel(PAPER.model, hw, costs=PAPER.costs.replace(overlap_blocks=blocks)))

    for mode in ("baseline", "repack+solver", "halo"):
        plain, piped = run(mode, 1, free), run(mode, 4, free)
        assert piped.step_time < plain.step_time, mode
        assert piped.intra_comm + piped.inter_comm < plain.intra_comm + plain.inter_comm, mode
        assert piped.full_inter_bytes == plain.full_inter_bytes and piped.sparse_inter_bytes == plain.sparse_inter_bytes
        assert piped.a2a_calls_full == 4 * plain.a2a_calls_full
    costly = HardwareConfig(a2a_latency=2e-3)
    assert run("baseline", 64, costly).step_time > run("baseline", 4, costly).step_time


@pytest.mark.parametrize("size", [2, 4, 8])
def test_each_peer_past_the_first_adds_its_latency_to_every_all_to_all_call(size):
    """An all-to-all in a group of s ranks pays a2a_peer_latency for each of its s - 2 peers past
    the first. On a step whose every all-to-all is in groups of s (a parent of s ranks: its full
    layers' exchanges, and the redistributions of a parent whose children are single ranks, or its
    own layout's sparse exchanges), the price with it is the price with a2a_latency raised by
    (s - 2) x a2a_peer_latency and no per-peer term, in both ratio readings; the experts'
    all-to-all over s ranks likewise; groups of 2 pay none."""
    peer, lat = 3e-4, 5e-5
    cluster = Cluster(size, 2, 64)
    lengths = ((0, 50), (1, 30), (2, 9))
    parent = Group(0, size, (0, 1, 2))
    singles = tuple(Group(r, 1, tuple(s for s in range(3) if s % size == r)) for r in range(size))
    plans = [
        StepPlan(cluster, lengths, (ParentPlan(parent, (parent,), "its own layout"),), "baseline").validate(),
        StepPlan(cluster, lengths, (ParentPlan(parent, singles, "", redistributed=True),), "redistribute").validate(),
    ]
    for reading in ("group", "link"):
        with_peer = HardwareConfig(ratio_reading=reading, a2a_latency=lat, a2a_peer_latency=peer, a2a_inter_latency=1e-3)
        raised = with_peer.replace(a2a_latency=lat + (size - 2) * peer, a2a_peer_latency=0.0)
        costs = CostsConfig(moe_all_to_all=False)
        for plan in plans:
            got = simulate(plan, CostModel(ModelConfig.from_name("tiny"), with_peer, costs=costs)).step_time
            want = simulate(plan, CostModel(ModelConfig.from_name("tiny"), raised, costs=costs)).step_time
            assert got == pytest.approx(want, rel=1e-12), (reading, plan.label)
            if size > 2:  # and the term is priced at all: without it the step is faster
                bare = simulate(plan, CostModel(ModelConfig.from_name("tiny"), with_peer.replace(a2a_peer_latency=0.0), costs=costs))
                assert bare.step_time < got
        experts = CostsConfig(ep_degree=size, ep_placement="inter" if size > 2 else "intra")
        paper = ModelConfig.from_name("paper")
        moe = CostModel(paper, with_peer, costs=experts).for_cluster(cluster).moe_layer_fixed()
        assert moe == pytest.approx(CostModel(paper, raised, costs=experts).for_cluster(cluster).moe_layer_fixed(), rel=1e-12)


@pytest.mark.parametrize("world", [64, 1024, 4096])
def test_fsdp2_gathers_a_paper_expert_slot_once_on_any_cluster(world):
    """The paper preset's 16 experts a slot (EP 8) are held by world / 8 ranks: 8 on 64 ranks, 128
    and 512 on 1,024 and 4,096. Sharded on their first dim those would be padded to 128 and 512 rows
    (8x and 32x the bytes); sharded on the dim that pads least they are held at their own size,
    3 matrices of 16 x hidden x expert_ffn a layer (the yardstick: the config's own figures)."""
    m = ModelConfig.from_name("paper")
    experts = CostModel(m, HardwareConfig(), 8, costs=CostsConfig(ep_degree=8)).sharded_params(world)[2]
    assert experts == m.n_layers * 3 * (m.n_experts // 8) * m.hidden * m.expert_ffn


@pytest.mark.slow
def test_the_whole_runs_change_is_every_steps_time_in_every_mode(tmp_path):
    """--whole-run: each mode's change over every step of the run against a yardstick computed
    here step by step (every step planned and simulated in every mode, summed per mode, against
    the baseline's sum), and the selected steps' figures as without it."""
    import experiments.ablation.__main__ as ablation
    from experiments.common.settings import cost_model
    from experiments.common.workload import workload_steps

    args = ["--model", "tiny", "--workload", "tiny", "--world-size", "8", "--gpus-per-node", "2", "--tokens-per-rank", "32"]
    args += ["--seeds", "1", "--steps", "25", "--no-progress"]
    _, summary = ablation.main([*args, "--whole-run", "--out", str(tmp_path / "w")])
    _, plain = ablation.main([*args, "--no-whole-run", "--out", str(tmp_path / "p")])
    assert plain["over_seeds"] == summary["over_seeds"] and "whole_run" not in plain
    from experiments.ablation.run import COMMAND
    from experiments.common import entry

    s = entry.parse(COMMAND, args)
    cost = cost_model(s)
    totals = {m: 0.0 for m in summary["whole_run"]["per_seed"]["0"]}
    for _, lengths in workload_steps(s.workload):
        for m in totals:
            totals[m] += simulate(make_plan(samples_from_lengths(lengths), s.cluster, cost, m), cost).step_time
    want = {m: 100 * (t / totals["baseline"] - 1) for m, t in totals.items()}
    got = summary["whole_run"]["per_seed"]["0"]
    assert got.keys() == want.keys() and all(got[m] == pytest.approx(want[m], rel=1e-9, abs=1e-9) for m in want)
    assert summary["whole_run"]["steps"] == {"0": 25} and any(abs(v) > 0.01 for v in got.values())
    from experiments.report.tables import headline

    text, _ = headline(str(tmp_path / "w"))  # the headline shows both, each labelled
    assert "over the steps with SP16/32 parents" in text and "over the whole run (every step of 25)" in text
    assert f"{got['repack']:+.1f}%" in text and "whole run" not in headline(str(tmp_path / "p"))[0]


@pytest.mark.slow
def test_the_sweeps_whole_run_column_is_the_ablations_whole_run_at_that_point(tmp_path):
    """sweep --whole-run records each mode's change over every step of each point's run: at one
    point, the ablation run alone at that fill and pricing gives the same figures, seed by seed."""
    import csv

    import experiments.ablation.__main__ as ablation
    from experiments.ablation import sweep

    small = ["--model", "tiny", "--workload", "tiny", "--world-size", "8", "--gpus-per-node", "2", "--tokens-per-rank", "32"]
    small += ["--steps", "20", "--seeds", "1"]
    sweep.main([*small, "--factors", "fill", "--whole-run", "--out", str(tmp_path / "s")])
    with open(tmp_path / "s" / "sweep.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["value"] == "0.5" and r["assignment_pricing"] == "compute"]
    _, summary = ablation.main([*small, "--fill", "0.5", "--assignment-pricing", "compute", "--whole-run", "--no-progress",
                                "--out", str(tmp_path / "a")])  # fmt: skip
    want = summary["whole_run"]["per_seed"]["0"]
    assert rows and {r["mode"] for r in rows} == set(want)
    for r in rows:
        assert float(r["whole_run_change_pct"]) == pytest.approx(want[r["mode"]]), r["mode"]
