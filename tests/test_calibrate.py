"""Calibration (experiments.calibrate) on 4 gloo ranks in 2 emulated nodes: a profile that loads
wherever a hardware preset does, and whose fits reproduce what it measured."""

import json
import math

import pytest

import experiments.ablation.__main__ as ablation
from config import CostsConfig, HardwareConfig, ModelConfig, SettingError
from experiments.calibrate.measure import (
    bare_layer_overhead,
    calibrate,
    fit_all_to_all,
    fit_fixed_cost,
    runtime_step_costs,
    runtime_step_plan,
)
from solver import CostModel
from solver.simulator import simulate
from tests.dist_utils import run_distributed


def _body(rank, world, path):
    profile = calibrate(ModelConfig.from_name("tiny"), 2, 32, quick=True, median_of=1, step_tokens=4)  # one timed run each: seconds
    if rank == 0:
        with open(path, "w") as f:
            json.dump(profile, f)


@pytest.mark.slow
def test_a_quick_calibration_writes_a_profile_the_planners_accept(tmp_path, capsys):
    path = str(tmp_path / "profile.json")
    run_distributed(_body, 4, path)
    profile = json.load(open(path))
    assert profile["world_size"] == 4 and profile["gpus_per_node"] == 2 and profile["provenance"]["commit"]
    hw = HardwareConfig.from_name(path)
    assert json.loads(json.dumps(hw.to_dict())) == profile["hardware"]  # round trip (a tuple setting reads back as a list)
    assert hw.ratio_reading in ("group", "link") and profile["fits"]["inter_measured"]
    sizes = {(r["group_size"], r["spans_nodes"]) for r in profile["measurements"]["all_to_all"]}
    assert sizes == {(2, False), (4, True)}  # every aligned group size, inside and across the emulated nodes
    for key in ("intra_node_bw", "inter_intra_ratio", "a2a_latency", "peak_flops", "gemm_efficiency", "attention_efficiency"):
        assert math.isfinite(hw.to_dict()[key]) and hw.to_dict()[key] > 0, key
    # each fixed cost: the larger of the isolated measurement's and the fit to the runtime's step
    m, net = profile["measurements"], profile["fits"]["all_to_all"]
    sizes = {"own": 1, "node": 2, "wide": 4, "node-halo": 2, "own-short": 1, "own-replicated": 1}
    assert m["runtime_step_sizes"] == sizes and m["runtime_step_tokens"] == 4
    assert all(t > 0 for t in m["runtime_step_s"].values())
    step = m["from_runtime_step"]
    # the isolated floor: a bare layer's forward share less its one attention call's (bare_layer_overhead)
    alone = bare_layer_overhead(m["layer_1_token_s"], profile["fits"]["attention"]["sample_latency"])
    assert hw.layer_overhead == pytest.approx(max(alone, step["layer_overhead"]))
    assert hw.a2a_latency == pytest.approx(max(net["intra"]["a2a_latency"], step["a2a_latency"]))
    assert hw.a2a_inter_latency == pytest.approx(max(net["inter"][net["reading"]]["a2a_inter_latency"], step["a2a_inter_latency"]))
    assert hw.halo_latency == pytest.approx(step["halo_latency"])  # no lone halo call to floor it: the halo step's fit
    # an attention call's cost per sample: the calls timed alone, or what the short-sample step took over the own step
    alone = profile["fits"]["attention"]["sample_latency"]
    assert hw.attention_sample_latency == pytest.approx(max(alone, step["attention_sample_latency"]))
    # the experts' all-to-all, measured like the exchanges, inside and across the emulated nodes, and
    # the share of it hidden behind compute from the runtime's EP2 step and its timers
    assert {(r["group_size"], r["spans_nodes"]) for r in m["experts_all_to_all"]} == {(2, False), (4, True)}
    assert hw.experts_intra_bw > 0 and hw.experts_inter_bw > 0
    overlap = m["experts_overlap"]
    assert overlap["ep_degree"] == 2 and overlap["all_to_all_s"] > 0 and 0 <= overlap["moe_overlap"] <= 1
    assert CostsConfig.from_name(path).moe_overlap == profile["costs"]["moe_overlap"] == overlap["moe_overlap"]
    # FSDP2's gathers and reductions: the share hidden, fitted from the own step against the same on
    # replicated parameters, and the parameters' element size (fp32 here), in the profile's costs
    costs = CostsConfig.from_name(path)
    assert costs.param_bytes == hw.bytes_per_element == 4
    assert 0 <= costs.grad_sync_overlap <= 1 and costs.grad_sync_overlap == step["grad_sync_overlap"]
    # the planners take it where they take a preset
    ablation.main(
        [
            "--hardware",
            path,
            "--costs",
            path,
            "--steps",
            "10",
            "--seeds",
            "1",
            "--out",
            str(tmp_path / "abl"),
            "--no-progress",
            "--no-whole-run",
        ]
    )
    assert "commit" in capsys.readouterr().out
    with pytest.raises(SettingError, match="has no 'hardware' object"):
        (tmp_path / "bad.json").write_text("{}")
        HardwareConfig.from_name(str(tmp_path / "bad.json"))
    with pytest.raises(SettingError, match=r"the profile lacks \['a2a_inter_latency'"):  # never a preset's values in silence
        (tmp_path / "partial.json").write_text(
            json.dumps({"hardware": {k: v for k, v in profile["hardware"].items() if k != "a2a_inter_latency"}})
        )
        HardwareConfig.from_name(str(tmp_path / "partial.json"))


@pytest.mark.parametrize("crossing", [0.0, 300e-6])
def test_the_all_to_all_fit_recovers_the_rates_it_was_given(crossing):
    """Times made from known rates (2 GB/s inside a node, 0.25 GB/s for a group across nodes, 50 us,
    and `crossing` more per call across nodes) fit back to them, and the group reading wins over
    the link reading on them."""
    lat, intra, inter = 50e-6, 2e9, 0.25e9
    rows = []
    for p in (2, 4, 8, 16):
        for per_peer in (1 << 10, 1 << 16, 1 << 20):
            rate, fixed = (intra, lat) if p <= 4 else (inter, lat + crossing)
            rows.append({"group_size": p, "spans_nodes": p > 4, "bytes_per_peer": per_peer, "seconds": fixed + per_peer * (p - 1) / rate})
    fit = fit_all_to_all(rows, node=4)
    assert fit["intra"]["intra_node_bw"] == pytest.approx(intra, rel=1e-6)
    assert fit["intra"]["a2a_latency"] == pytest.approx(lat, rel=1e-6)
    assert fit["reading"] == "group" and fit["inter"]["group"]["ratio"] == pytest.approx(8.0, rel=1e-6)
    assert fit["inter"]["group"]["a2a_inter_latency"] == pytest.approx(crossing, abs=1e-9)


@pytest.mark.parametrize("reading", ["group", "link"])
def test_the_all_to_all_fit_recovers_a_latency_per_peer_from_groups_of_two_sizes_across_nodes(reading):
    """Times made with a2a_peer_latency (each peer past the first adds it to a call, as gloo sends
    to each peer in turn) on groups of 4 and 8 across nodes of 2 fit back to it and to the rest,
    under either reading; from groups of one size across nodes the term cannot be told from the
    crossing latency, and the fit says 0 (the times of one size then fit as well without it)."""
    lat, crossing, peer, intra, inter = 4e-3, 1e-3, 5e-4, 40e6, 6e6
    rows = []
    for p in (2, 4, 8):
        for per_peer in (768, 65280, 1048320):
            inter_peers = p - 2 if p > 2 else 0
            if reading == "group" and p > 2:
                wire = per_peer * (p - 1) / inter
            else:
                wire = per_peer * (p - 1 - inter_peers) / intra + per_peer * inter_peers / inter
            fixed = lat + (crossing if p > 2 else 0.0) + peer * (p - 2)
            rows.append({"group_size": p, "spans_nodes": p > 2, "bytes_per_peer": per_peer, "seconds": fixed + wire})
    fit = fit_all_to_all(rows, node=2)
    got = fit["inter"][reading]
    assert fit["reading"] == reading and got["rel_rms"] < 1e-9
    assert got["a2a_peer_latency"] == pytest.approx(peer, rel=1e-6) and got["a2a_inter_latency"] == pytest.approx(crossing, rel=1e-6)
    assert got["inter_node_bw"] == pytest.approx(inter, rel=1e-6) and got["sizes"] == [4, 8]
    one = fit_all_to_all([r for r in rows if r["group_size"] != 8], node=2)["inter"][reading]
    assert one["a2a_peer_latency"] == 0.0 and one["sizes"] == [4]
    assert one["a2a_inter_latency"] == pytest.approx(crossing + 2 * peer, rel=1e-6)  # the one size's per-peer part in it


def test_a_slow_large_transfer_barely_moves_the_fitted_latencies():
    """The fits weigh each point by its relative error: the largest transfers measured 20% slow (a
    noisy 40 ms point) leave the latencies, which the small calls of a step pay, close to what the
    small points say (an unweighted fit takes ~40% off the cross-node latency on these rows)."""
    lat, crossing = 5e-3, 2e-3
    rows = []
    for p, rate, fixed in ((2, 33e6, lat), (4, 25e6, lat + crossing)):
        for per_peer in (768, 65280, 1048320):
            slow = 1.2 if per_peer > 1e6 else 1.0
            seconds = slow * (fixed + per_peer * (p - 1) / rate)
            rows.append({"group_size": p, "spans_nodes": p > 2, "bytes_per_peer": per_peer, "seconds": seconds})
    fit = fit_all_to_all(rows, node=2)
    assert fit["intra"]["a2a_latency"] == pytest.approx(lat, rel=0.05)
    assert fit["inter"]["group"]["a2a_inter_latency"] == pytest.approx(crossing, rel=0.15)


@pytest.mark.parametrize(
    "field, size, tokens, halo",
    [
        ("layer_overhead", 1, 2, False),
        ("a2a_latency", 2, 2, False),
        ("a2a_inter_latency", 8, 2, False),
        ("a2a_latency", 2, 48, False),
        ("halo_latency", 2, 2, True),
        ("halo_latency", 2, 48, True),
    ],
)
def test_the_fixed_cost_fits_recover_what_a_step_was_priced_with(field, size, tokens, halo):
    """A runtime step priced by the simulator with a known fixed cost (a layer's per pass on ranks
    alone, a call's latency on groups of a node, what crossing nodes adds on groups of 8 over 4
    nodes, a halo call's latency on groups of a node whose sparse layers run by halo exchange; on
    2 or 48 tokens per rank) fits back to it from a profile that had another, and a step faster
    than the price without it fits to none; a plan that does not pay it cannot fit it (ranks
    alone pay no call; groups without halo children no halo call)."""
    cfg, known = ModelConfig.from_name("tiny"), 3.7e-3
    hw = HardwareConfig(collective_latency=2e-3, layer_overhead=1e-3, a2a_latency=5e-4, a2a_inter_latency=2e-4, halo_latency=1e-4)
    priced = CostModel(cfg, hw.replace(**{field: known}), costs=runtime_step_costs(hw))
    step = simulate(runtime_step_plan(8, 2, size, tokens, halo), priced).step_time
    assert fit_fixed_cost(step, cfg, hw, 8, 2, field, size, tokens, halo) == pytest.approx(known, rel=1e-9)
    assert fit_fixed_cost(1e-9, cfg, hw, 8, 2, field, size, tokens, halo) == 0.0
    if size > 1:
        with pytest.raises(ValueError, match=f"does not pay {field}"):
            fit_fixed_cost(step, cfg, hw, 8, 2, field, 1 if field == "a2a_latency" else 2)


def test_the_fixed_costs_fitted_round_by_round_are_the_median_of_each_rounds_fit():
    """Runtime steps priced by the simulator with known fixed costs, timed in five rounds, two of
    them spoilt (a slow spell over a whole round; one round's wide step alone 5x): every cost fits
    back to the known value, each round's fit on the known values of the costs before it, and the
    spoilt rounds show in the rounds' fits. Rounds of unequal length are an error."""
    from experiments.calibrate.measure import STEP_FITS, fit_fixed_costs

    cfg = ModelConfig.from_name("tiny")
    known = {"layer_overhead": 2.1e-3, "a2a_latency": 3.3e-3, "a2a_inter_latency": 4.7e-3, "halo_latency": 1.9e-3}
    hw = HardwareConfig(collective_latency=2e-3, layer_overhead=1e-4, a2a_latency=1e-4, a2a_inter_latency=1e-4, halo_latency=1e-4)
    priced = CostModel(cfg, hw.replace(**known), costs=runtime_step_costs(hw))
    sizes = {"own": 1, "node": 2, "wide": 8, "node-halo": 2}
    clean = {key: simulate(runtime_step_plan(8, 2, sizes[key], 2, key == "node-halo"), priced).step_time for key in sizes}
    rounds = {key: [t * 3, t * (5 if key == "wide" else 1), t, t, t] for key, t in clean.items()}
    fitted_hw, fitted, each = fit_fixed_costs(rounds, cfg, hw, 8, 2, sizes, 2)
    for field, _ in STEP_FITS:
        assert fitted[field] == pytest.approx(known[field], rel=1e-9), field
        assert getattr(fitted_hw, field) == pytest.approx(known[field], rel=1e-9), field
        assert each[field][2:] == pytest.approx([known[field]] * 3, rel=1e-9), field
    assert each["a2a_inter_latency"][1] > 2 * known["a2a_inter_latency"]  # the round whose wide step alone was slow
    assert each["a2a_latency"][1] == pytest.approx(known["a2a_latency"], rel=1e-9)  # ...spoils no other cost of it
    with pytest.raises(ValueError, match="unequal rounds"):
        fit_fixed_costs({**rounds, "wide": rounds["wide"][:4]}, cfg, hw, 8, 2, sizes, 2)


def test_the_hidden_share_of_fsdps_collectives_fits_back_from_the_own_step_against_the_replicated_one():
    """The own step priced with a known share of FSDP2's gathers and reductions hidden and a known
    layer cost, and the same step on replicated parameters (no gathers or reductions): the share
    fits back from the difference, and the layer's cost from the own step on it. The share is
    bounded: a step that added no more than the calls' latency hides everything, one that added
    more than all the bytes' time hides nothing."""
    from experiments.calibrate.measure import REPLICATED_STEP, fit_fixed_costs, fit_grad_sync_overlap

    cfg, share, layer = ModelConfig.from_name("tiny"), 0.35, 2.1e-3
    hw = HardwareConfig(collective_latency=2e-3, layer_overhead=1e-4, bytes_per_element=4)
    plan = runtime_step_plan(8, 2, 1, 2)
    own = simulate(plan, CostModel(cfg, hw.replace(layer_overhead=layer), costs=runtime_step_costs(hw, share))).step_time
    bare = simulate(plan, CostModel(cfg, hw.replace(layer_overhead=layer), costs=runtime_step_costs(hw).replace(grad_sync=False)))
    assert own > bare.step_time
    sizes = {"own": 1, REPLICATED_STEP: 1}
    fitted_hw, fitted, each = fit_fixed_costs({"own": [own] * 3, REPLICATED_STEP: [bare.step_time] * 3}, cfg, hw, 8, 2, sizes, 2)
    assert list(fitted) == ["grad_sync_overlap", "layer_overhead"]
    assert fitted["grad_sync_overlap"] == pytest.approx(share, rel=1e-9)
    assert fitted["layer_overhead"] == pytest.approx(layer, rel=1e-9) and fitted_hw.layer_overhead == pytest.approx(layer, rel=1e-9)
    assert fit_grad_sync_overlap(0.0, cfg, hw, 8, 2) == 1.0
    assert fit_grad_sync_overlap(1e3, cfg, hw, 8, 2) == 0.0


@pytest.mark.parametrize(
    ("model", "field", "other"),
    [("tiny-gdn", "linear_block_latency", "attention_sample_latency"), ("tiny", "attention_sample_latency", "linear_block_latency")],
)
def test_the_cost_per_sample_fits_back_from_what_the_short_sample_step_took_over_the_own_step(model, field, other):
    """The runtime step of ranks alone with SHORT_STEP_SAMPLES short samples each and the step with
    one, priced by the simulator with a known cost per sample (a linear kind's per block, each
    sample one block; an attention kind's per sample of a call): what the first took more fits
    back to it from a profile that had another, whatever the other costs (they are the same in
    both steps); no more than the price without it fits to 0; the other field is not the one fitted."""
    from experiments.calibrate.measure import SHORT_STEP_SAMPLES, fit_short_step_latency, short_step_field

    cfg, known = ModelConfig.from_name(model), 2.3e-3
    assert short_step_field(cfg) == field
    hw = HardwareConfig(collective_latency=2e-3, layer_overhead=1e-3, **{field: 4e-4})
    costs = runtime_step_costs(hw)
    priced = CostModel(cfg, hw.replace(**{field: known, "layer_overhead": 5e-3}), costs=costs)
    short, own = (simulate(runtime_step_plan(8, 2, 1, 2, samples=k), priced).step_time for k in (SHORT_STEP_SAMPLES, 1))
    assert short > own
    assert fit_short_step_latency(short - own, cfg, hw, 8, 2) == pytest.approx(known, rel=1e-9)
    assert fit_short_step_latency(0.0, cfg, hw, 8, 2) == 0.0
    # a cost of the other kind in the steps is not what the fit recovers
    skewed = CostModel(cfg, hw.replace(**{field: known, other: 1e-3}), costs=costs)
    s2, o2 = (simulate(runtime_step_plan(8, 2, 1, 2, samples=k), skewed).step_time for k in (SHORT_STEP_SAMPLES, 1))
    assert fit_short_step_latency(s2 - o2, cfg, hw.replace(**{other: 1e-3}), 8, 2) == pytest.approx(known, rel=1e-9)


@pytest.mark.parametrize(("model", "field"), [("tiny-gdn", "linear_block_latency"), ("tiny", "attention_sample_latency")])
def test_the_fixed_costs_fit_the_cost_per_sample_first_and_the_rest_on_it(model, field):
    """The runtime steps, the short-sample one among them, priced with known costs: the cost per
    sample (a linear kind's per block) fits back from the short step less the own step, and the
    layer's and the call's costs from their steps on it (each step's one sample priced at the
    fitted cost); a profile's cost per sample above the fitted one (the mixer or the attention
    calls timed alone) is kept, as every isolated figure is."""
    from experiments.calibrate.measure import SHORT_STEP, STEP_SAMPLES, fit_fixed_costs

    cfg = ModelConfig.from_name(model)
    known = {field: 1.7e-3, "layer_overhead": 2.1e-3, "a2a_latency": 3.3e-3}
    hw = HardwareConfig(collective_latency=2e-3, layer_overhead=1e-4, a2a_latency=1e-4, **{field: 5e-4})
    priced = CostModel(cfg, hw.replace(**known), costs=runtime_step_costs(hw))
    sizes = {"own": 1, "node": 2, SHORT_STEP: 1}
    clean = {k: simulate(runtime_step_plan(8, 2, sizes[k], 2, samples=STEP_SAMPLES.get(k, 1)), priced).step_time for k in sizes}
    fitted_hw, fitted, each = fit_fixed_costs({k: [t, t, t] for k, t in clean.items()}, cfg, hw, 8, 2, sizes, 2)
    assert list(fitted) == [field, "layer_overhead", "a2a_latency"]
    for name, value in known.items():
        assert fitted[name] == pytest.approx(value, rel=1e-9), name
        assert getattr(fitted_hw, name) == pytest.approx(value, rel=1e-9), name
    higher = fit_fixed_costs({k: [t] for k, t in clean.items()}, cfg, hw.replace(**{field: 9e-3}), 8, 2, sizes, 2)[0]
    assert getattr(higher, field) == 9e-3
    with pytest.raises(ValueError, match="unequal rounds"):
        fit_fixed_costs({**{k: [t, t] for k, t in clean.items()}, SHORT_STEP: [clean[SHORT_STEP]]}, cfg, hw, 8, 2, sizes, 2)


def test_an_all_to_all_whose_largest_transfer_took_no_longer_than_the_latency_fits_a_rate_the_hardware_accepts():
    """Noise can make the largest transfer inside a node no slower than the fitted latency (a
    calibration of one timed run each); its whole time then bounds the rate, and the profile's
    hardware takes it (before, a 1 ps floor gave 1e18 B/s and the calibration failed)."""
    rows = [
        {"bytes_per_peer": b, "group_size": 2, "spans_nodes": False, "seconds": s}
        for b, s in ((1 << 10, 4e-3), (1 << 16, 5e-3), (1 << 20, 3e-3))
    ]
    fit = fit_all_to_all(rows, 2)["intra"]
    assert fit["a2a_latency"] > 3e-3  # the case: the largest transfer's 3 ms is within the fitted latency
    assert fit["intra_node_bw"] == pytest.approx((1 << 20) / 3e-3, rel=1e-9)
    HardwareConfig(intra_node_bw=fit["intra_node_bw"], experts_intra_bw=fit["intra_node_bw"])


def test_a_fixed_cost_fitted_at_its_floor_is_kept_flagged_and_unflagged_when_refitted():
    from experiments.calibrate.measure import keep_fit

    hw = HardwareConfig(a2a_latency=5e-4, halo_latency=1e-4)
    floored = keep_fit(hw, "halo_latency", 0.0)  # the halo step took no longer than its price without it
    assert floored.halo_latency == 0.0 and floored.floored == ("halo_latency",)
    assert keep_fit(floored, "halo_latency", 2e-3).floored == ()  # a later fit above the floor clears it
    # a cost with an isolated measurement keeps it when the step fits lower: a measurement, not the floor
    kept = keep_fit(hw, "a2a_latency", 0.0)
    assert kept.a2a_latency == 5e-4 and kept.floored == ()


def test_a_linear_kind_is_timed_and_priced_at_its_own_rate():
    """A linear kind's rows time its mixer (convolution, gates, recurrence) against the FLOPs that
    solver.cost.gated_delta_flops counts for it (the layer less its projections), and
    linear_efficiency prices exactly those and the state-passing maps: attention, and a windowed
    model's sparse layers, stay at attention_efficiency, which an unset linear_efficiency also takes."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from experiments.calibrate.measure import measure_attention, measure_linear
    from solver.cost import FWD_BWD_COMPUTE, gated_delta_flops, gated_delta_map_flops, with_sparse_defaults

    cfg = with_sparse_defaults(ModelConfig.from_name("tiny-gdn"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the timer's barrier: one rank
    try:
        attention = measure_attention(cfg, [16, 64], "torch", torch.device("cpu"), torch.float32, 1)
        rows = measure_linear(cfg, [16, 64], "torch", torch.device("cpu"), torch.float32, 1)
    finally:
        dist.destroy_process_group()
    p = cfg.sparse_params
    # all heads and one key head's (v_heads 8, then 2); one sample, then samples of a quarter block
    linear = [(r["v_heads"], r["length"], r["samples"], r["blocks"]) for r in rows if r["kind"] == "gated_delta"]
    # no sparse attention to time; one sample, then samples of 4 tokens
    packs = [(r["kind"], r["length"], r["samples"]) for r in attention]
    assert packs == [("full", 16, 1), ("full", 16, 4), ("full", 64, 1), ("full", 64, 16)]
    for r in attention:  # the pack's FLOPs: each sample's causal pairs
        each = r["length"] // r["samples"]
        assert r["flops"] == pytest.approx(FWD_BWD_COMPUTE * r["samples"] * 2 * 2 * cfg.n_heads * cfg.head_dim * each * (each + 1) / 2)
    assert linear == [
        (8, 16, 1, 1),
        (8, 16, 4, 4),
        (8, 64, 1, 4),
        (8, 64, 16, 16),
        (2, 16, 1, 1),
        (2, 16, 4, 4),
        (2, 64, 1, 4),
        (2, 64, 16, 16),
    ]
    heads = (p["k_heads"], p["v_heads"], p["head_k_dim"], p["head_v_dim"])

    def mixer_flops(n, heads=heads):
        t = gated_delta_flops([n], cfg.hidden, *heads, conv_kernel=p["conv_kernel"], block=p["block"], parts=True)
        return float((t["convolution"] + t["recurrence_matmuls"] + t["recurrence_solve"])[0])

    assert len(linear) == len(rows)
    for r in rows:
        split = (1, 2, p["head_k_dim"], p["head_v_dim"]) if r["v_heads"] == 2 else heads
        each = r["length"] // r["samples"]
        assert r["seconds"] > 0 and r["flops"] == pytest.approx(FWD_BWD_COMPUTE * r["samples"] * mixer_flops(each, split))
    hw = HardwareConfig()
    lengths = np.array([100.0, 5000.0])
    slow = CostModel(cfg, hw.replace(linear_efficiency=0.01))
    assert slow.sparse_attn_time(lengths) == pytest.approx([mixer_flops(n) / (hw.peak_flops * 0.01) for n in lengths])
    assert slow.map_time(lengths) == pytest.approx(gated_delta_map_flops(lengths, p) / (hw.peak_flops * 0.01))
    unset = CostModel(cfg, hw)
    assert slow.full_attn_time(lengths) == pytest.approx(unset.full_attn_time(lengths))
    assert unset.sparse_attn_time(lengths) == pytest.approx([mixer_flops(n) / (hw.peak_flops * hw.attention_efficiency) for n in lengths])
    windowed = ModelConfig.from_name("tiny")
    assert CostModel(windowed, hw.replace(linear_efficiency=0.01)).sparse_attn_time(lengths) == pytest.approx(
        CostModel(windowed, hw).sparse_attn_time(lengths)
    )


def test_the_attention_fit_separates_the_rate_from_what_each_sample_costs():
    """Rows made from a known fixed cost, rate and per-sample cost (as measure_attention's: one
    sample of each length, and packs of 4-token samples) fit back to them, the per-sample cost as a
    forward's share; without one the fit keeps it at 0."""
    from experiments.calibrate.measure import fit_attention

    peak, fixed, eff, per_sample = 1e11, 3e-4, 0.2, 6e-4
    rows = []
    for n in (32, 64, 128, 256):
        for samples, flops in ((1, 2e4 * n * n), (n // 4, 2e4 * 16 * n // 4)):
            rows.append({"flops": flops, "samples": samples, "seconds": fixed + flops / (eff * peak) + samples * per_sample})
    fit = fit_attention(rows, peak)
    assert fit["efficiency"] == pytest.approx(eff, rel=1e-6) and fit["fixed_s"] == pytest.approx(fixed, rel=1e-6)
    assert fit["sample_latency"] == pytest.approx(per_sample / 3, rel=1e-6)
    flat = [{**r, "seconds": fixed + r["flops"] / (eff * peak)} for r in rows]
    assert fit_attention(flat, peak)["sample_latency"] == pytest.approx(0.0, abs=1e-12)


def test_the_linear_fit_separates_the_rate_from_what_each_block_costs():
    """Rows made from a known fixed cost, rate and per-block cost (as measure_linear's: one sample
    of each length, and as many blocks in short samples, with all heads and with a quarter of
    them) fit back to them; without a per-block cost the fit keeps it at 0."""
    from experiments.calibrate.measure import fit_linear

    peak, fixed, eff, per_block = 1e11, 2e-4, 0.3, 5e-4
    rows = []
    for heads in (1.0, 0.25):
        for n in (32, 64, 128, 256):
            for flops, blocks in ((heads * 4e4 * n, n // 16), (heads * 1e4 * n, n // 4)):
                rows.append({"flops": flops, "blocks": blocks, "seconds": fixed + flops / (eff * peak) + blocks * per_block})
    fit = fit_linear(rows, peak)
    assert fit["efficiency"] == pytest.approx(eff, rel=1e-6) and fit["fixed_s"] == pytest.approx(fixed, rel=1e-6)
    assert fit["block_latency"] == pytest.approx(per_block / 3, rel=1e-6)  # a forward's share: backward counts twice
    flat = [{**r, "seconds": fixed + r["flops"] / (eff * peak)} for r in rows]
    assert fit_linear(flat, peak)["block_latency"] == pytest.approx(0.0, abs=1e-12)
