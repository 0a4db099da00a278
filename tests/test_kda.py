"""Kimi Delta Attention (model.kda, solver.kinds.kda): the blockwise form against our float64
token-by-token recurrence and flash-linear-attention's naive KDA, the affine map of a span, the
layer cut over ranks with passed states and halos against the whole, its cost against what it
runs, and a KDA hybrid's step over gloo in every mode and every way against one process."""

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from config import Cluster, HardwareConfig, ModelConfig, SettingError
from model import kda
from solver import CostModel, make_plan, samples_from_lengths
from solver.cost import sparse_cost, with_sparse_defaults
from solver.modes import MODES
from tests.dist_utils import run_distributed
from tests.test_linear_attention import _state, l2

F64 = torch.float64


def _inputs(t: int, h: int, dk: int, dv: int, seed: int, dtype=F64):
    """A sequence's q, k, v, g, beta as a KDA layer gives them: unit-norm keys and queries, a log
    decay per key channel in [-2, 0), strengths in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2(torch.randn(t, h, dk, generator=gen, dtype=dtype))
    k = l2(torch.randn(t, h, dk, generator=gen, dtype=dtype))
    v = torch.randn(t, h, dv, generator=gen, dtype=dtype)
    g = -2 * torch.rand(t, h, dk, generator=gen, dtype=dtype)
    beta = torch.rand(t, h, generator=gen, dtype=dtype)
    return q, k, v, g, beta


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(1, 70),
    h=st.integers(1, 3),
    dk=st.integers(1, 9),
    dv=st.integers(1, 7),
    block=st.sampled_from([1, 3, 16, 64]),
    with_state=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_blockwise_form_equals_the_token_by_token_recurrence(t, h, dk, dv, block, with_state, seed):
    q, k, v, g, beta = _inputs(t, h, dk, dv, seed)
    s0 = _state(h, dk, dv, seed) if with_state else None
    want_o, want_s = kda.recurrent(q, k, v, g, beta, s0)
    got_o, got_s = kda.blockwise(q, k, v, g, beta, s0, block=block)
    torch.testing.assert_close(got_o, want_o, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_s, want_s, rtol=1e-10, atol=1e-12)


def test_strong_decays_over_a_long_block_stay_finite():
    """Log decays of -30 a token over a block of 64: exp(c_i - c_j) is at most 1 for every pair
    the block uses, so nothing overflows, and the block form still equals the recurrence."""
    q, k, v, g, beta = _inputs(64, 2, 4, 3, 7)
    g = g * 15
    want_o, want_s = kda.recurrent(q, k, v, g, beta)
    got_o, got_s = kda.blockwise(q, k, v, g, beta, block=64)
    assert torch.isfinite(got_o).all() and torch.isfinite(got_s).all()
    torch.testing.assert_close(got_o, want_o, rtol=1e-9, atol=1e-12)


def test_a_decay_of_zero_in_every_channel_is_the_ungated_delta_rule():
    """A per-channel decay that is the same in every channel is the gated delta rule's per-head
    decay: model.linear's form gives the same outputs (the two rules agree where they overlap)."""
    from model import linear

    q, k, v, g, beta = _inputs(29, 2, 5, 3, 3)
    per_head = g[..., 0]
    o1, s1 = kda.blockwise(q, k, v, per_head[..., None].expand_as(g).contiguous(), beta, block=8)
    o2, s2 = linear.blockwise(q, k, v, per_head, beta, block=8)
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s1, s2, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("t, dk, dv, seed", [(1, 3, 2, 0), (37, 5, 3, 1), (80, 4, 6, 2)])
def test_a_spans_final_state_is_its_transition_of_the_incoming_state_plus_its_own(t, dk, dv, seed):
    q, k, v, g, beta = _inputs(t, 2, dk, dv, seed)
    s0 = _state(2, dk, dv, seed)
    a = kda.transition(k, g, beta, block=16)
    b = kda.blockwise(q, k, v, g, beta, block=16)[1]
    torch.testing.assert_close(a @ s0 + b, kda.blockwise(q, k, v, g, beta, s0, block=16)[1], rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention (fla-core) is not installed")
def test_flash_linear_attentions_naive_kda_agrees():
    """fla's naive_recurrent_kda (it computes in float32) against our float64 recurrence, with
    grouped values (2 key heads for 4 value heads) and an initial state: within float32's
    rounding over the sequence (2e-5 relative, the two reference forms' own disagreement)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla warns that Triton falls back to the CPU here
        from fla.ops.kda.naive import naive_recurrent_kda

    q, k, v, g, beta = _inputs(45, 2, 6, 5, 11)
    _, _, v4, g4, beta4 = _inputs(45, 4, 6, 5, 12)
    s0 = _state(4, 6, 5, 3)
    want_o, want_s = kda.recurrent(q.repeat_interleave(2, 1), k.repeat_interleave(2, 1), v4, g4, beta4, s0)
    got_o, got_s = naive_recurrent_kda(
        *(x[None].float() for x in (q, k, v4, g4, beta4)), initial_state=s0[None].float(), output_final_state=True
    )
    torch.testing.assert_close(got_o[0].double(), want_o, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got_s[0].double(), want_s, rtol=2e-5, atol=2e-5)


def _layer(hk=2, hv=4, dk=5, dv=3, kernel=4, block=4, hidden=12, rank=3, seed=0):
    torch.manual_seed(seed)
    return kda.KimiDeltaAttention(hidden, hk, hv, dk, dv, kernel, block=block, gate_rank=rank).double()


def _by_hand(layer: kda.KimiDeltaAttention, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The layer written out from its docstring, token by token with our recurrence."""
    n = x.shape[0]
    proj = layer.w_in(x)
    mixed, ga, fa, b = proj.split([layer.channels, layer.rank, layer.rank, layer.hv], dim=-1)
    z, f = layer.g_b(ga), layer.f_b(fa)
    out, base = [], 0
    for length in lengths:
        m = mixed[base : base + length]
        pad = torch.cat([m.new_zeros(layer.kernel - 1, m.shape[1]), m])
        conv = torch.stack([(pad[i : i + layer.kernel] * layer.conv.T).sum(0) for i in range(length)])
        q, kk, v = torch.nn.functional.silu(conv).split([layer.hk * layer.dk, layer.hk * layer.dk, layer.hv * layer.dv], dim=-1)
        q = l2(q.view(length, layer.hk, layer.dk)).repeat_interleave(layer.hv // layer.hk, 1)
        kk = l2(kk.view(length, layer.hk, layer.dk)).repeat_interleave(layer.hv // layer.hk, 1)
        g = -layer.A_log.exp()[:, None] * torch.nn.functional.softplus(
            f[base : base + length].view(length, layer.hv, layer.dk) + layer.dt_bias
        )
        o, _ = kda.recurrent(q, kk, v.view(length, layer.hv, layer.dv), g, torch.sigmoid(b[base : base + length]))
        out.append(o)
        base += length
    o = torch.cat(out)
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + layer.eps) * layer.norm
    return layer.w_out(o.reshape(n, -1) * torch.sigmoid(z))


def test_the_layer_equals_its_written_out_form_with_grouped_values():
    layer = _layer()
    lengths = [7, 1, 9]
    x = torch.randn(sum(lengths), 12, dtype=F64, generator=torch.Generator().manual_seed(1))
    out, finals, tails = layer(x, [0, 7, 8, 17])
    torch.testing.assert_close(out, _by_hand(layer, x, lengths), rtol=1e-10, atol=1e-12)
    assert finals.shape == (3, 4, 5, 3) and tails.shape == (3, 3, layer.channels)


def test_a_sample_cut_over_ranks_with_passed_states_and_halos_is_the_whole_sample():
    """Each sample cut into chunks, each run as a rank would, from the state and the convolution
    halo its previous chunk hands on: the same outputs, final states and gradients of every
    parameter as one call over the whole batch (the gated delta rule's test, on a KDA layer)."""
    from tests.test_linear_attention import assert_cut_is_whole

    assert_cut_is_whole(_layer(kernel=4))


def test_the_cost_model_counts_a_kda_hybrids_parameters_as_the_model_has_them():
    """CostModel.total_params of tiny-kda against the built model's parameters, less the norms, the
    convolution and the per-channel gate biases the cost model leaves out (under 1% of a layer)."""
    from model.hybrid import HybridMoE

    cfg = with_sparse_defaults(ModelConfig.from_name("tiny-kda"))
    model = HybridMoE(cfg)
    left_out = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("norm.weight", ".norm", "conv", "A_log", "dt_bias")))
    assert CostModel(cfg, HardwareConfig()).total_params() == sum(p.numel() for p in model.parameters()) - left_out


def test_the_layers_flops_count_what_its_projections_do():
    """torch's FLOP counter over one forward of the layer's projections (its linear maps) sees
    exactly the projections term of kda_flops."""
    from torch.utils.flop_counter import FlopCounterMode

    from solver.kinds.kda import kda_flops

    layer = _layer(hk=2, hv=4, dk=8, dv=8, block=8, hidden=16, rank=4)
    x = torch.randn(16, 16, dtype=F64)
    with FlopCounterMode(display=False) as counter:
        mixed, z, a, b = layer._project(x)
        layer.w_out(torch.randn(16, layer.hv * layer.dv, dtype=F64))
    p = {"k_heads": 2, "v_heads": 4, "head_k_dim": 8, "head_v_dim": 8, "conv_kernel": 4, "block": 8, "gate_rank": 4}
    assert counter.get_total_flops() == kda_flops([16], 16, p, parts=True)["projections"][0]


def test_a_kda_hybrid_plans_in_every_mode_and_prices_its_state_passing():
    """tiny-kda on 8 ranks in nodes of 2: every mode plans; its halo children's rows are the
    convolution's channels, its maps Hv x K x (K + V), its chain's states Hv x K x V."""
    cost = CostModel(with_sparse_defaults(ModelConfig.from_name("tiny-kda")), HardwareConfig()).for_cluster(Cluster(8, 2, 32))
    p, b = cost.model.sparse_params, cost.hw.bytes_per_element
    assert cost.halo_row_bytes() == (2 * p["k_heads"] * p["head_k_dim"] + p["v_heads"] * p["head_v_dim"]) * b
    assert cost.state_bytes() == p["v_heads"] * p["head_k_dim"] * (p["head_k_dim"] + p["head_v_dim"]) * 4  # float32 states
    assert cost.carried_bytes() == p["v_heads"] * p["head_k_dim"] * p["head_v_dim"] * 4
    for mode in MODES:
        make_plan(samples_from_lengths([100, 40, 17, 9, 3]), Cluster(8, 2, 32), cost, mode).validate()
    assert sparse_cost("kda").halo_ways == sparse_cost("gated_delta").halo_ways


# ----- a KDA hybrid's step over gloo -------------------------------------------------------------
def _kda_config():
    return ModelConfig.from_name("tiny-kda", aux_loss_coef=0.01)


def _kda_plans():
    """Every mode's plan, the hand-made ones (an SP8 parent in its own layout, repacked into
    node-local children; halo children of 2 and 3 ranks, one across nodes; the parent's own
    layout with halos; redistributed) and the halo plans passing states by the chain."""
    from tests import test_model_distributed as tmd
    from tests.test_linear_attention import chained
    from tests.test_strategies_distributed import hand_plans

    cost = CostModel(_kda_config(), HardwareConfig())
    cluster = Cluster(tmd.WORLD, tmd.NODE, 32)
    solved = [make_plan(samples_from_lengths(tmd.LENGTHS), cluster, cost, m) for m in MODES]
    halo, naive, redistribute = hand_plans()
    return [*solved, *tmd.hand_plans(), halo, naive, redistribute, chained(halo), chained(naive)]


def _kda_step_body(rank, world, ref):
    from kernels.exchange import ExchangeGroups
    from tests.test_model_distributed import distinct_layouts
    from tests.test_strategies_distributed import assert_step

    groups = ExchangeGroups(world)
    for plan in distinct_layouts(_kda_plans()):
        assert_step(_kda_config(), plan, ref, groups, f"kda {plan.label} {plan.hash}")


@pytest.mark.slow
def test_a_kda_hybrids_step_gives_the_single_process_step_in_every_mode_and_moves_the_priced_bytes():
    """A whole step of tiny-kda on 8 gloo ranks, float64: the loss and every parameter's gradient
    equal one process's, in every way its KDA layers run (Ulysses with key heads replicated over a
    group wider than them, state passing in one round and by the chain, samples cut over 2, 3, 4
    and 8 ranks), and every site's counted bytes equal the simulator's."""
    from tests.test_model_distributed import LENGTHS, WORLD, reference

    run_distributed(_kda_step_body, WORLD, reference(LENGTHS, _kda_config()))


def test_the_kda_plans_cover_what_the_step_test_claims():
    plans = _kda_plans()
    p = _kda_config().sparse_params
    assert {plan.label for plan in plans} >= set(MODES)
    widest = max(q.group.size for plan in plans for q in plan.parents if not any(c.halo for c in q.children))
    assert widest > p["k_heads"] and p["v_heads"] % widest == 0, "a Ulysses group wider than the key heads: replicated"
    cuts = {c.size for plan in plans for q in plan.parents for c in q.children if c.halo and c.size > 1}
    assert {2, 3, 4} <= cuts, cuts
    assert any(c.chain for plan in plans for q in plan.parents for c in q.children), "a chain"
    assert any(c.halo and not c.chain and c.size > 1 for plan in plans for q in plan.parents for c in q.children), "one round"


def test_paper_kda_places_its_layers_as_kimi_linears_config_lists_them():
    """Kimi-Linear-48B-A3B's config.json: KDA at layers 1-3, 5-7, ..., 21-23 and 25-26, MLA at 4,
    8, ..., 24 and 27 (1-based); its parameters as the cost model counts them, near the model
    card's 48B total and 3B active (its shared expert and dense first layer left out, MLA's
    low-rank key/value projection priced full-rank)."""
    kda_layers = [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26]
    full_layers = [4, 8, 12, 16, 20, 24, 27]
    cfg = with_sparse_defaults(ModelConfig.from_name("paper-kda"))
    assert [i + 1 for i, t in enumerate(cfg.layer_types) if t == "S"] == kda_layers
    assert [i + 1 for i, t in enumerate(cfg.layer_types) if t == "F"] == full_layers
    cost = CostModel(cfg, HardwareConfig())
    assert 45e9 < cost.total_params() < 55e9 and 2.8e9 < cost.active_params() < 3.3e9


def test_value_heads_of_another_size_are_priced_by_their_size():
    """MLA's full layers (q/k heads of 192, v heads of 128): QK^T at 192 and PV at 128; the entry
    moves q and k at 192 and v at 128 a head, each key/value head replicated over a group wider
    than them; the exit the outputs at 128; the halo row keys at 192 and values at 128."""
    from solver.flops import attention_flops

    base = ModelConfig.from_name("tiny").replace(n_heads=8, n_kv_heads=2, head_dim=12, v_head_dim=4)
    cost = CostModel(base, HardwareConfig()).for_cluster(Cluster(8, 8, 32))
    b = cost.hw.bytes_per_element
    assert attention_flops([10.0], base)[0] == 2 * 8 * (12 + 4) * 10
    # a group of 4: the 2 key/value heads each go to 2 ranks, so 4 copies of k's and v's elements
    assert cost.entry_row_bytes(4) == (8 * 12 + 4 * 12 + 4 * 4) * b
    assert cost.entry_row_bytes(2) == (8 * 12 + 2 * 12 + 2 * 4) * b
    assert cost.exit_row_bytes() == 8 * 4 * b and cost.kv_row_bytes() == 2 * (12 + 4) * b
    same = base.replace(v_head_dim=None)
    assert CostModel(same, HardwareConfig()).for_cluster(Cluster(8, 8, 32)).entry_row_bytes(4) == (8 + 4 + 4) * 12 * b


def test_the_runtime_refuses_what_it_does_not_build_in_one_line(tmp_path, capsys):
    import experiments.train.__main__ as train
    from model.hybrid import HybridMoE

    HybridMoE(ModelConfig.from_name("tiny").replace(v_head_dim=4))  # value heads of their own size: built
    with pytest.raises(SettingError, match=r"does not build the gated attention output with value heads of another size"):
        HybridMoE(ModelConfig.from_name("tiny").replace(v_head_dim=4, attn_output_gate=True))
    with pytest.raises(SystemExit):
        train.main(["--v-head-dim", "4", "--attn-output-gate", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "(--attn-output-gate with --v-head-dim)" in err
