"""Simulator on hand-computed cases, and the ablation command end to end on a short run."""

import json
import os

import numpy as np
import pytest

from experiments import ablation
from experiments.results import read_run
from solver import MODES, Cluster, CostModel, Group, HardwareConfig, ModelConfig, PlanError, make_plan, samples_from_lengths
from solver.estimate import PlanEstimate
from solver.plan import NODE_LOCAL, ParentPlan, StepPlan
from solver.simulator import simulate

PAPER = CostModel(ModelConfig.from_name("paper"), HardwareConfig())


def test_single_rank_step_is_the_sum_of_its_layer_costs():
    cost = PAPER
    plan = make_plan(samples_from_lengths([5000, 1200, 7]), Cluster(1, 1, 32768), cost, "baseline")
    r = simulate(plan, cost)
    lens = np.array([5000, 1200, 7], dtype=float)
    m = cost.model
    expect = 3.0 * (
        lens.sum() * (m.n_layers * cost.layer_token_time + cost.head_token_time)
        + m.n_full * cost.full_attn_time(lens).sum()
        + m.n_sparse * cost.sparse_attn_time(lens).sum()
    )
    assert r.step_time == pytest.approx(expect, rel=1e-9)
    assert r.intra_comm == r.inter_comm == r.imbalance_wait == 0
    assert r.compute == pytest.approx(expect, rel=1e-9)


def test_breakdown_adds_up_and_lower_bound_holds():
    cluster = Cluster(32, 8, 32768)
    rng = np.random.default_rng(1)
    lengths = [110_000] + list(rng.integers(200, 9000, 90))
    for mode in MODES:
        r = simulate(make_plan(samples_from_lengths(lengths), cluster, PAPER, mode), PAPER)
        assert r.compute + r.intra_comm + r.inter_comm + r.imbalance_wait == pytest.approx(r.step_time, rel=1e-9)
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
    assert b.a2a_calls_full == r.a2a_calls_full == 2 * 2 * PAPER.model.n_full


def test_node_local_plan_matches_across_modes():
    plan = make_plan(samples_from_lengths([3000] * 20), Cluster(16, 8, 32768), PAPER, "repack")
    assert all(p.reason == NODE_LOCAL for p in plan.parents)
    base = make_plan(samples_from_lengths([3000] * 20), Cluster(16, 8, 32768), PAPER, "baseline")
    assert simulate(plan, PAPER).step_time == pytest.approx(simulate(base, PAPER).step_time)


def test_ablation_end_to_end_short_run(tmp_path, capsys):
    out = tmp_path / "abl"
    rows, summary = ablation.main(["--steps", "40", "--seed", "0", "--out", str(out), "--no-progress"])
    text = capsys.readouterr().out
    assert "the paper" in text and "-5.95%" in text and "-7.61%" in text
    assert os.path.exists(out / "steps.csv") and os.path.exists(out / "summary.json")
    got_rows, got = read_run(str(out))
    assert len(got_rows) == len(rows) == 3 * len(summary["selected_steps"]) > 0
    assert got["context"]["commit"] and got["config"]["workload"]["seed"] == 0
    modes = got["modes"]
    assert modes["repack+solver"]["mean_step_time_s"] <= modes["baseline"]["mean_step_time_s"]
    assert all(r["widest_parent"] > 8 for r in got_rows)
    json.dumps(got)


def test_ablation_rejects_a_malformed_trace(tmp_path):
    bad = tmp_path / "t.csv"
    bad.write_text("step,length\n0,100\n1,abc\n")
    with pytest.raises(SystemExit, match="'abc' is not an integer"):
        ablation.main(["--trace", str(bad), "--out", str(tmp_path / "o"), "--no-progress"])


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
    est = PlanEstimate(plan.length_of, cluster, cost).plan_time(plan.parents)
    assert simulate(plan, cost).step_time == pytest.approx(est, rel=1e-9)


def test_a_cost_model_without_a_cluster_prices_no_exchange():
    cost = CostModel(ModelConfig.from_name("paper"), HardwareConfig())
    with pytest.raises(PlanError, match=r"use cost.for_cluster\(cluster\)"):
        cost.exchange_line(8)
