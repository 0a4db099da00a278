"""The gated delta rule (model.linear): the blockwise form against the token-by-token recurrence,
the affine map of a span against running it, state passing over chunks of a sample (in one
process and over gloo ranks) against the whole sample, gradients against numerical
differentiation, and flash-linear-attention's own reference recurrence against ours."""

import importlib.util
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model import linear
from tests.dist_utils import run_distributed

F64 = torch.float64


def _inputs(t: int, h: int, dk: int, dv: int, seed: int, dtype=F64):
    """A sequence's q, k, v, g, beta as a Gated DeltaNet layer gives them: unit-norm keys and
    queries, log decays in [-1, 0), strengths in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = l2(torch.randn(t, h, dk, generator=gen, dtype=dtype))
    k = l2(torch.randn(t, h, dk, generator=gen, dtype=dtype))
    v = torch.randn(t, h, dv, generator=gen, dtype=dtype)
    g = -torch.rand(t, h, generator=gen, dtype=dtype)
    beta = torch.rand(t, h, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def _state(h, dk, dv, seed, dtype=F64):
    return torch.randn(h, dk, dv, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)


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
    o_ref, s_ref = linear.recurrent(q, k, v, g, beta, s0)
    o, s = linear.blockwise(q, k, v, g, beta, s0, block=block)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 50), dk=st.integers(1, 8), dv=st.integers(1, 6), seed=st.integers(0, 10**6))
def test_a_spans_final_state_is_its_transition_of_the_incoming_state_plus_its_own(t, dk, dv, seed):
    """S_out = A S_in + B for any S_in, with A from `transition` and B the span's state from zero:
    checked against running the span from S_in."""
    q, k, v, g, beta = _inputs(t, 2, dk, dv, seed)
    s_in = _state(2, dk, dv, seed)
    a = linear.transition(k, g, beta, block=8)
    b = linear.blockwise(q, k, v, g, beta, block=8)[1]
    _, s_out = linear.recurrent(q, k, v, g, beta, s_in)
    torch.testing.assert_close(a @ s_in + b, s_out, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("how", ["chain", "scan"])
def test_chunks_with_passed_states_give_the_whole_samples_outputs_and_gradients(how):
    """A sample cut into 5 chunks (one of them empty), each run from the incoming state that
    incoming_states composes from the chunks' maps: the same outputs, final state and gradients
    (q, k, v, g, beta and the initial state) as the recurrence over the whole sample."""
    t, h, dk, dv = 41, 2, 6, 4
    cuts = [0, 9, 9, 20, 33, 41]
    whole = [x.requires_grad_() for x in (*_inputs(t, h, dk, dv, 3), _state(h, dk, dv, 3))]
    chunks = [x.detach().clone().requires_grad_() for x in whole]
    weight = torch.randn(t, h, dv, dtype=F64, generator=torch.Generator().manual_seed(9))

    o_ref, s_ref = linear.recurrent(*whole[:5], whole[5])
    ((o_ref * weight).sum() + s_ref.square().sum()).backward()

    q, k, v, g, beta, s0 = chunks
    spans = list(zip(cuts, cuts[1:]))
    maps = [
        (linear.transition(k[a:b], g[a:b], beta[a:b], block=4), linear.blockwise(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], block=4)[1])
        for a, b in spans
    ]
    states = linear.incoming_states(maps, s0, how)
    outs = [linear.blockwise(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s, block=4)[0] for (a, b), s in zip(spans, states)]
    a_last, b_last = maps[-1]
    s_end = a_last @ states[-1] + b_last
    o = torch.cat(outs)
    ((o * weight).sum() + s_end.square().sum()).backward()

    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s_end, s_ref, rtol=1e-10, atol=1e-12)
    for name, x, y in zip(("q", "k", "v", "g", "beta", "initial state"), chunks, whole):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"gradient of {n}: {m}")


def test_gradients_of_the_blockwise_form_match_numerical_differentiation():
    """torch.autograd.gradcheck (central differences in float64) over every input, the initial
    state included, with a block boundary inside the sequence."""
    q, k, v, g, beta = _inputs(7, 2, 3, 2, 11)
    s0 = _state(2, 3, 2, 11)
    args = [x.requires_grad_() for x in (q, k, v, g, beta, s0)]

    def run(q, k, v, g, beta, s0):
        o, s = linear.blockwise(q, k, v, g, beta, s0, block=4)
        return o, s

    assert torch.autograd.gradcheck(run, args, eps=1e-6, atol=1e-7)
    assert torch.autograd.gradcheck(lambda k, g, beta: linear.transition(k, g, beta, block=3), [k, g, beta], eps=1e-6, atol=1e-7)


def test_a_packed_batch_runs_each_sample_from_its_own_state():
    lengths = [5, 1, 12, 7]
    t = sum(lengths)
    q, k, v, g, beta = _inputs(t, 2, 4, 3, 5)
    states = torch.stack([_state(2, 4, 3, 20 + i) for i in range(len(lengths))])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    o, finals = linear.varlen(q, k, v, g, beta, cu, states, block=4)
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        o_i, s_i = linear.recurrent(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], states[i])
        torch.testing.assert_close(o[a:b], o_i, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(finals[i], s_i, rtol=1e-10, atol=1e-12)


def test_the_convolution_of_chunks_with_their_halos_is_the_convolution_of_the_whole():
    """Each chunk convolved with the last W - 1 rows of the chunks before it (zeros at the sample's
    start) gives the rows of the whole sequence's convolution, against torch's conv1d."""
    t, ch, w = 23, 5, 4
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(t, ch, dtype=F64, generator=gen)
    weight = torch.randn(ch, w, dtype=F64, generator=gen)
    ref = torch.nn.functional.conv1d(x.T[None], weight[:, None, :], padding=w - 1, groups=ch)[0, :, :t].T
    torch.testing.assert_close(linear.causal_conv(x, weight), ref, rtol=1e-12, atol=1e-12)
    cuts = [0, 2, 10, 10, 23]
    padded = torch.cat([x.new_zeros(w - 1, ch), x])
    chunks = [linear.causal_conv(x[a:b], weight, padded[a : a + w - 1]) for a, b in zip(cuts, cuts[1:])]
    torch.testing.assert_close(torch.cat(chunks), ref, rtol=1e-12, atol=1e-12)


def test_bad_shapes_are_refused_naming_the_tensor():
    q, k, v, g, beta = _inputs(6, 2, 4, 3, 0)
    with pytest.raises(ValueError, match=r"v must be \[T=6, H=2, V\]"):
        linear.blockwise(q, k, v[:5], g, beta)
    with pytest.raises(ValueError, match=r"beta must be \[T=6, H=2\]"):
        linear.blockwise(q, k, v, g, beta[:, :1])
    with pytest.raises(ValueError, match=r"the initial state must be \[H=2, K=4, V=3\]"):
        linear.blockwise(q, k, v, g, beta, torch.zeros(2, 3, 4, dtype=F64))
    with pytest.raises(ValueError, match=r"block=0"):
        linear.blockwise(q, k, v, g, beta, block=0)
    with pytest.raises(ValueError, match=r"the halo must be \[W - 1 = 3, C=5\]"):
        linear.causal_conv(torch.zeros(4, 5), torch.zeros(5, 4), torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to T=6"):
        linear.varlen(q, k, v, g, beta, torch.tensor([0, 4, 3, 6]))


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention (fla-core) is not installed")
def test_flash_linear_attentions_reference_recurrence_agrees():
    """fla's naive recurrence (float32 inside) against ours in float64, from an initial state."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla warns that Triton falls back to the CPU
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    q, k, v, g, beta = _inputs(33, 3, 8, 5, 4)
    s0 = _state(3, 8, 5, 4)
    o, s = linear.blockwise(q, k, v, g, beta, s0, block=16)
    o_fla, s_fla = naive_recurrent_gated_delta_rule(
        *(x[None].float() for x in (q, k, v, beta, g)), initial_state=s0[None].float(), output_final_state=True
    )
    torch.testing.assert_close(o_fla[0].double(), o, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(s_fla[0].double(), s, rtol=2e-5, atol=2e-6)


# ----- over gloo ranks ------------------------------------------------------------------------
T, H, DK, DV = 29, 2, 5, 3
CUTS = [0, 4, 5, 17, 29]  # rank r holds tokens CUTS[r]:CUTS[r+1]


def _pass_states_body(rank, world, how, ref):
    whole = [x.detach() for x in (*_inputs(T, H, DK, DV, 7), _state(H, DK, DV, 7))]
    a, b = CUTS[rank], CUTS[rank + 1]
    q, k, v, g, beta = (x[a:b].clone().requires_grad_() for x in whole[:5])
    s0 = whole[5].clone().requires_grad_()
    weight = torch.randn(T, H, DV, dtype=F64, generator=torch.Generator().manual_seed(9))[a:b]
    m_a = linear.transition(k, g, beta, block=4)
    m_b = linear.blockwise(q, k, v, g, beta, block=4)[1]
    s_in = linear.pass_states(m_a, m_b, s0 if rank == 0 else None, how=how)
    s_in.retain_grad()
    o, s_out = linear.blockwise(q, k, v, g, beta, s_in, block=4)
    loss = (o * weight).sum() + (s_out.square().sum() if rank == world - 1 else 0.0)
    loss.backward()
    o_ref, grads_ref, state_ref, state_grad_ref = ref
    torch.testing.assert_close(o, o_ref[a:b], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s_in, state_ref[rank], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        s_in.grad, state_grad_ref[rank], rtol=1e-9, atol=1e-11, msg=lambda m: f"rank {rank}, its loss's gradient of its incoming state: {m}"
    )
    for name, x, y in zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta), grads_ref):
        torch.testing.assert_close(x.grad, y[a:b], rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"rank {rank}, gradient of {n}: {m}")
    if rank == 0:
        torch.testing.assert_close(s0.grad, grads_ref[5], rtol=1e-9, atol=1e-11)


def _single_process_reference():
    """One process, the token-by-token recurrence chunk after chunk (autograd carries the state):
    outputs, the gradients of every input, each chunk's incoming state, and the gradient its
    chunk's own loss gives it."""
    whole = [x.detach().clone().requires_grad_() for x in (*_inputs(T, H, DK, DV, 7), _state(H, DK, DV, 7))]
    q, k, v, g, beta, s = whole
    weight = torch.randn(T, H, DV, dtype=F64, generator=torch.Generator().manual_seed(9))
    outs, states = [], []
    for a, b in zip(CUTS, CUTS[1:]):
        states.append(s.detach())
        o, s = linear.recurrent(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)
        outs.append(o)
    o = torch.cat(outs)
    ((o * weight).sum() + s.square().sum()).backward()
    # what each chunk's own loss sends back into its incoming state (a rank's share; the chunks
    # after it reach the state through the chunk's map, whose inputs' gradients are checked)
    local = []
    last = len(CUTS) - 2
    for r, (a, b) in enumerate(zip(CUTS, CUTS[1:])):
        s_in = states[r].clone().requires_grad_()
        o_r, s_end = linear.recurrent(*(x.detach()[a:b] for x in (q, k, v, g, beta)), s_in)
        ((o_r * weight[a:b]).sum() + (s_end.square().sum() if r == last else 0.0)).backward()
        local.append(s_in.grad)
    return o.detach(), [x.grad for x in whole], states, local


@pytest.mark.slow
@pytest.mark.parametrize("how", ["scan", "chain"])
def test_state_passing_over_gloo_ranks_gives_the_single_process_outputs_and_gradients(how):
    """4 ranks hold consecutive chunks of one sample (one of a single token) and obtain their incoming
    states by pass_states: every rank's outputs, incoming state, the gradient its loss sends into
    that state, the gradients of its inputs (through the later ranks' maps) and the initial
    state's gradient equal one process's recurrence over the whole sample."""
    run_distributed(_pass_states_body, len(CUTS) - 1, how, _single_process_reference())


def l2(x: torch.Tensor) -> torch.Tensor:
    """q and k's norm as the gated delta rule takes it (fla's kernels, transformers' Qwen3-Next): x / sqrt(|x|^2 + 1e-6)."""
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)


# ----- the layer ------------------------------------------------------------------------------
def _layer(hk=2, hv=4, dk=5, dv=3, kernel=4, block=4, hidden=12, seed=0):
    torch.manual_seed(seed)
    return linear.GatedDeltaNet(hidden, hk, hv, dk, dv, conv_kernel=kernel, block=block).double()


def _by_hand(layer: linear.GatedDeltaNet, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The layer written out for one sample at a time: torch's conv1d, the token-by-token
    recurrence per value head with its key head picked by index."""
    outs = []
    a = 0
    for n in lengths:
        xs = x[a : a + n]
        a += n
        ch, vd = layer.channels, layer.hv * layer.dv
        mixed, z, dec, stren = (xs @ layer.w_in.weight.T).split([ch, vd, layer.hv, layer.hv], dim=-1)
        mixed = torch.nn.functional.conv1d(mixed.T[None], layer.conv[:, None, :], padding=layer.kernel - 1, groups=ch)[0, :, :n].T
        mixed = torch.nn.functional.silu(mixed)
        q, k, v = mixed.split([layer.hk * layer.dk, layer.hk * layer.dk, vd], dim=-1)
        q = l2(q.reshape(n, layer.hk, layer.dk))
        k = l2(k.reshape(n, layer.hk, layer.dk))
        v = v.reshape(n, layer.hv, layer.dv)
        g = -layer.A_log.exp() * torch.nn.functional.softplus(dec + layer.dt_bias)
        beta = torch.sigmoid(stren)
        heads = []
        for j in range(layer.hv):
            kh = j // (layer.hv // layer.hk)
            o, _ = linear.recurrent(q[:, kh : kh + 1], k[:, kh : kh + 1], v[:, j : j + 1], g[:, j : j + 1], beta[:, j : j + 1])
            heads.append(o)
        o = torch.cat(heads, dim=1)
        o = o / torch.sqrt(o.square().mean(-1, keepdim=True) + layer.eps) * layer.norm
        outs.append((o.reshape(n, vd) * torch.nn.functional.silu(z)) @ layer.w_out.weight.T)
    return torch.cat(outs)


def test_the_layer_equals_its_written_out_form_with_grouped_values():
    layer = _layer()
    lengths = [9, 1, 14]
    x = torch.randn(sum(lengths), 12, dtype=F64)
    cu = [0, 9, 10, 24]
    out, finals, tails = layer(x, cu)
    torch.testing.assert_close(out, _by_hand(layer, x, lengths), rtol=1e-10, atol=1e-12)
    assert finals.shape == (3, 4, 5, 3) and tails.shape == (3, 3, layer.channels)


def test_a_sample_cut_over_ranks_with_passed_states_and_halos_is_the_whole_sample():
    """Each sample cut into chunks, each chunk run as a rank would (its own call), from the state
    and the convolution halo its previous chunk hands on: the same outputs, final states and
    gradients of every parameter as one call over the whole batch."""
    assert_cut_is_whole(_layer(kernel=4))


def assert_cut_is_whole(layer):
    """A linear layer (hidden 12, kernel 4) over two samples cut into chunks, each run from the
    state and halo its previous chunk hands on, against one call over the whole batch."""
    lengths = [11, 2]
    cuts = [[0, 2, 2, 7, 11], [0, 1, 2]]  # a chunk shorter than the kernel's reach, and an empty one
    x = torch.randn(sum(lengths), 12, dtype=F64, generator=torch.Generator().manual_seed(4))
    whole, finals, _ = layer(x, [0, 11, 13])
    (whole.square().sum() + finals.square().sum()).backward()
    expected = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()

    outs, loss, base = [], 0.0, 0
    for n, c in zip(lengths, cuts):
        state, halo = None, None
        for lo, hi in zip(c, c[1:]):
            o, state, halo = layer(x[base + lo : base + hi], [0, hi - lo], state, halo)
            outs.append(o)
        loss = loss + state.square().sum()
        base += n
    out = torch.cat(outs)
    (out.square().sum() + loss).backward()
    torch.testing.assert_close(out, whole, rtol=1e-10, atol=1e-12)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"gradient of {n}: {m}")


def test_the_layers_flops_count_what_its_matmuls_do():
    """torch's FLOP counter over one forward of the layer (samples a whole number of blocks long)
    sees the projections and the recurrence's matmuls: exactly those terms of gated_delta_flops."""
    from torch.utils.flop_counter import FlopCounterMode

    layer = _layer(block=8)
    lengths = [16, 8]
    x = torch.randn(sum(lengths), 12, dtype=F64)
    with FlopCounterMode(display=False) as counter:
        layer(x, [0, 16, 24])
    parts = linear.gated_delta_flops(lengths, 12, k_heads=2, v_heads=4, head_k_dim=5, head_v_dim=3, conv_kernel=4, block=8, parts=True)
    assert counter.get_total_flops() == pytest.approx(float(sum(parts["projections"]) + sum(parts["recurrence_matmuls"])), rel=1e-12)


def test_bad_layer_settings_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match=r"n_v_heads=3 must be a multiple of n_k_heads=2"):
        linear.GatedDeltaNet(8, 2, 3, 4, 4)
    with pytest.raises(ValueError, match=r"conv_kernel=10 reaches past a block of 8 tokens"):
        linear.GatedDeltaNet(8, 2, 2, 4, 4, conv_kernel=10, block=8)


# ----- a Gated DeltaNet hybrid ----------------------------------------------------------------
def test_a_gdn_hybrids_packed_samples_share_no_state_and_every_layer_learns():
    """tiny-gdn on one process in float64: the final hidden states of two samples packed into one
    batch equal each sample run alone (a linear layer starts every sample from a zero state and
    its convolution from zeros), and a loss reaches every parameter of every linear layer."""
    from config import ModelConfig
    from model.hybrid import HybridMoE, LinearBlock, LocalPlacement

    cfg = ModelConfig.from_name("tiny-gdn")
    torch.manual_seed(0)
    model = HybridMoE(cfg).double()
    assert [type(b) is LinearBlock for b in model.blocks] == [t == "S" for t in cfg.layer_types]
    a, b = torch.randint(0, cfg.vocab, (19,)), torch.randint(0, cfg.vocab, (7,))
    packed, _ = model(torch.cat([a, b]), LocalPlacement([19, 7], cfg, "torch"))
    alone = torch.cat([model(a, LocalPlacement([19], cfg, "torch"))[0], model(b, LocalPlacement([7], cfg, "torch"))[0]])
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-12)

    tokens = torch.cat([a, b])
    model.loss(tokens, torch.roll(tokens, -1), LocalPlacement([19, 7], cfg, "torch"), len(tokens)).backward()
    for i, blk in enumerate(model.blocks):
        if isinstance(blk, LinearBlock):
            for name, p in blk.mixer.named_parameters():
                assert p.grad is not None and p.grad.abs().sum() > 0, f"block {i}: {name} has no gradient"


def test_the_cost_model_counts_a_gdn_hybrids_parameters_as_the_model_has_them():
    """CostModel.total_params for tiny-gdn and paper-gdn's shapes (built small: 2 layers of its
    widths) against the parameters of the model built from them, less what the cost model leaves
    out by design (norm weights, the convolution, the per-head decay and bias)."""
    from config import HardwareConfig, ModelConfig
    from model.hybrid import HybridMoE, LinearBlock
    from solver import CostModel

    paper = ModelConfig.from_name("paper-gdn")  # without what the runtime does not build (tests/test_hf.py prices those)
    small_paper = paper.replace(
        n_layers=4,
        n_experts=8,
        top_k=2,
        vocab=1000,
        architecture="hybrid",
        shared_expert_ffn=0,
        shared_expert_gate=False,
        attn_output_gate=False,
    )
    for cfg in (ModelConfig.from_name("tiny-gdn"), small_paper):
        model = HybridMoE(cfg)
        left_out = sum(p.numel() for n, p in model.named_parameters() if "norm" in n or n.endswith(("conv", "A_log", "dt_bias")))
        counted = sum(p.numel() for p in model.parameters()) - left_out
        assert counted == CostModel(cfg, HardwareConfig()).total_params(), cfg.name
        assert any(isinstance(b, LinearBlock) for b in model.blocks)


def test_a_gdn_hybrid_plans_in_every_mode_and_the_simulator_prices_state_passings_rows_and_maps():
    """Two ranks in nodes of one, samples of 50 and 9 tokens: every mode plans and simulates; in the
    parent's own layout with state passing, each sample's second chunk receives the 3 rows its
    convolution (kernel 4) reaches back to and the first chunk's outgoing state by the chain (or
    its map, unchained), fwd and bwd, in each of the 3 S layers: the sparse bytes the simulator
    prices, counted here by hand (rows in bf16, states and maps in float32), and 8 bytes an
    element of the states with state_dtype=float64."""
    from config import Cluster, CostsConfig, HardwareConfig, ModelConfig
    from solver import CostModel, make_plan, samples_from_lengths
    from solver.modes import MODES
    from solver.simulator import simulate

    cfg = ModelConfig.from_name("tiny-gdn")
    cost = CostModel(cfg, HardwareConfig(bytes_per_element=2), costs=CostsConfig(recompute="none"))
    plan = make_plan(samples_from_lengths([20, 9]), Cluster(1, 1, 32), cost, "baseline")
    r = simulate(plan, cost)
    assert r.step_time > 0 and r.model_flops == pytest.approx(cost.model_flops([20, 9]))
    plans = {m: make_plan(samples_from_lengths([50, 9]), Cluster(2, 1, 32), cost, m) for m in MODES}
    assert all(simulate(p, cost).step_time > 0 for p in plans.values())
    naive = plans["parent+halo"]
    assert naive.parents[0].children[0].halo and naive.parents[0].group.size == 2
    p = cfg.sparse_params
    row = 2 * (2 * p["k_heads"] * p["head_k_dim"] + p["v_heads"] * p["head_v_dim"])  # bf16 pre-conv channels
    # states and maps in float32 (state_dtype auto: a chunked kernel's state is float32 under bf16 activations)
    state = 4 * p["v_heads"] * p["head_k_dim"] * p["head_v_dim"]  # the chain carries S [K, V] per value head
    a_and_b = 4 * p["v_heads"] * p["head_k_dim"] * (p["head_k_dim"] + p["head_v_dim"])  # a map: A [K, K] and B [K, V]
    assert cfg.layer_pattern.count("S") * cfg.n_layers // len(cfg.layer_pattern) == 3
    # one hop each: the chain carries less than a map, in as many calls, so the planner takes it
    assert naive.parents[0].children[0].chain
    for plan, carried in ((naive, state), (unchained(naive), a_and_b)):
        per_layer = 2 * (3 * row + carried)  # two samples, each: 3 rows and one state or map
        r = simulate(plan, cost)
        assert (r.sparse_intra_bytes, r.sparse_inter_bytes) == (0, 2 * 3 * per_layer)  # across nodes; fwd and bwd, 3 S layers
    wide = cfg.replace(sparse_params={**p, "state_dtype": "float64"})
    r = simulate(naive, CostModel(wide, HardwareConfig(bytes_per_element=2), costs=CostsConfig(recompute="none")))
    assert r.sparse_inter_bytes == 2 * 3 * 2 * (3 * row + 2 * state)


def test_a_linear_halo_child_passes_states_the_way_the_simulator_prices_cheaper():
    """The planner marks each halo child of a linear kind with the cheaper way to pass its states
    (every earlier map in one round, or the chain, one hop after another), as
    solver.reference.halo_pass prices them; on the paper's GDN hybrid at 32 ranks the other
    way's plan never simulates faster. Both ways occur: the paper's 2 MB maps go by the chain,
    the maps of heads of 16 (32 KB) in one round, where a call's latency outweighs their bytes."""
    import numpy as np

    from config import Cluster, HardwareConfig, ModelConfig
    from solver import CostModel, make_plan, samples_from_lengths
    from solver.simulator import simulate

    paper = ModelConfig.from_name("paper-gdn")
    small = paper.replace(sparse_params={**paper.sparse_params, "head_k_dim": 16, "head_v_dim": 16})
    rng = np.random.default_rng(0)
    steps = [[300_000, 100_000], [200_000, *rng.integers(500, 6000, 150).tolist()], [500_000]]
    ways = {}
    for (cfg, lengths), mode in itertools.product(itertools.product((paper, small), steps), ("halo", "parent+halo")):
        cost = CostModel(cfg, HardwareConfig())
        plan = make_plan(samples_from_lengths(lengths), Cluster(32, 8, 32768), cost, mode)
        halos = [c for p in plan.parents for c in p.children if c.halo and c.size > 1]
        ways.setdefault(cfg.sparse_params["head_k_dim"], set()).update(c.chain for c in halos)
        other = chained(plan) if not all(c.chain for c in halos) else unchained(plan)
        assert simulate(plan, cost).step_time <= simulate(other, cost).step_time, (mode, len(lengths))
    assert ways == {128: {True}, 16: {False}}


def unchained(plan):
    from dataclasses import replace

    from solver import StepPlan, Way

    parents = tuple(replace(p, children=tuple(replace(c, way=Way.HALO) if c.halo else c for c in p.children)) for p in plan.parents)
    return StepPlan(plan.cluster, plan.lengths, parents, plan.label).validate()


# Ulysses for linear layers over gloo: 8 ranks in nodes of 2 (tests/test_model_distributed.py's
# batch); tiny-gdn's 4 key heads for 8 value heads (an SP8 group replicates each key head over 2
# ranks) and a variant with a key head per value head
LINEAR_CONFIGS = {
    "gva": "tiny-gdn",
    "mha": {"k_heads": 8, "v_heads": 8, "head_k_dim": 8, "head_v_dim": 8, "conv_kernel": 4, "block": 16},
}


def _linear_config(name):
    from config import ModelConfig

    spec = LINEAR_CONFIGS[name]
    cfg = ModelConfig.from_name("tiny-gdn", aux_loss_coef=0.01)
    return cfg if isinstance(spec, str) else cfg.replace(sparse_params={**cfg.sparse_params, **spec})


def _linear_plans(name):
    """gva: every mode's plan and the hand-made ones: one SP8 parent in its own layout, repacked
    into node-local children, halo children (one across nodes whose convolution reaches two ranks
    back, one of two samples), the parent's own layout with halos (empty chunks), redistributed,
    and the halo plans passing states by the chain. mha (where the heads split differently): the
    first two, by Ulysses."""
    from config import Cluster, HardwareConfig
    from solver import CostModel, make_plan, samples_from_lengths
    from solver.modes import MODES
    from tests import test_model_distributed as tmd
    from tests.test_strategies_distributed import hand_plans

    cost = CostModel(_linear_config(name), HardwareConfig())
    cluster = Cluster(tmd.WORLD, tmd.NODE, 32)
    solved = [make_plan(samples_from_lengths(tmd.LENGTHS), cluster, cost, m) for m in MODES]
    halo, naive, redistribute = hand_plans()
    if name == "mha":
        return list(tmd.hand_plans())
    return [*solved, *tmd.hand_plans(), halo, naive, redistribute, chained(halo), chained(naive)]


def chained(plan):
    """`plan` with every halo child passing its states by the chain (Way.CHAIN)."""
    from dataclasses import replace

    from solver import StepPlan, Way

    parents = tuple(replace(p, children=tuple(replace(c, way=Way.CHAIN) if c.halo else c for c in p.children)) for p in plan.parents)
    return StepPlan(plan.cluster, plan.lengths, parents, plan.label).validate()


def _linear_step_body(rank, world, refs):
    from kernels.exchange import ExchangeGroups
    from tests.test_model_distributed import distinct_layouts, hand_plans
    from tests.test_strategies_distributed import assert_sharded_ep2_step, assert_step
    from tests.test_strategies_distributed import hand_plans as strategy_plans

    groups = ExchangeGroups(world)
    for name in LINEAR_CONFIGS:
        for plan in distinct_layouts(_linear_plans(name)):  # modes that plan the same layout: one step
            assert_step(_linear_config(name), plan, refs[name], groups, f"{name} {plan.label} {plan.hash}")
    # FSDP2 with expert parallelism (EP2): the same loss and gathered gradients, on the solver's
    # repack+solver plan (three ranks hold no token: their linear layers' parameters still get
    # zero gradients, or the reduce-scatters differ in size) under full recompute (the exchanges
    # and state passing run again in the backward), the hand-made repacked plan and halo children
    idle = next(p for p in _linear_plans("gva") if p.label == "repack+solver")
    for plan, recompute in ((idle, "full"), (hand_plans()[1], "none"), (strategy_plans()[0], "none")):
        assert_sharded_ep2_step(_linear_config("gva"), plan, refs["gva"], groups, rank, recompute)


@pytest.mark.slow
def test_a_gdn_hybrids_step_gives_the_single_process_step_in_every_mode_and_moves_the_priced_bytes():
    """A whole step of a GDN hybrid on 8 gloo ranks, float64: the loss and every parameter's
    gradient equal one process's over the whole batch, in every mode: the linear layers by Ulysses
    (value heads and the key heads they read split over each group, key heads replicated where
    the group is wider) and by state passing (halo children and the parent's own layout: each
    chunk's convolution halo, and the maps of its sample's earlier chunks or, by the chain, the
    state of the chunk before, point to point), with
    grouped and one-to-one key heads, replicated and FSDP2 with expert parallelism; the bytes every
    rank counted at each site equal the simulator's for the same plan."""
    from tests.test_model_distributed import LENGTHS, WORLD, reference

    refs = {name: reference(LENGTHS, _linear_config(name)) for name in LINEAR_CONFIGS}
    run_distributed(_linear_step_body, WORLD, refs)


def test_the_linear_plans_cover_what_the_step_test_claims():
    from solver.cost import sparse_cost
    from solver.layout import halo_transfers, state_hops, state_transfers
    from solver.modes import MODES
    from tests.test_model_distributed import NODE

    gva = _linear_plans("gva")
    assert {p.label for p in gva} == set(MODES)
    p = _linear_config("gva").sparse_params
    widest = max(q.group.size for plan in gva for q in plan.parents)
    assert widest > p["k_heads"] and p["v_heads"] % widest == 0, "a group wider than the key heads: replicated"
    assert any(plan.redistributes for plan in gva) and any(q.repacked for plan in gva for q in plan.parents)
    halos = [(plan, c) for plan in gva for q in plan.parents for c in q.children if c.halo and c.size > 1]
    assert any(c.start // NODE != (c.stop - 1) // NODE for _, c in halos), "a halo child across nodes"
    reach = sparse_cost("gated_delta").first_key
    conv = [t for plan, c in halos for t in halo_transfers(plan.child_layout, c, reach, p)]
    assert any(t.dst - t.src >= 2 for t in conv), "a convolution reaching two ranks back"
    idle = next(p for p in gva if p.label == "repack+solver")
    assert len(idle.child_layout.local_chunks(1)) == 0, "a rank that holds no token"
    maps = [(t.dst, t.sample) for plan, c in halos if not c.chain for t in state_transfers(plan.child_layout, c)]
    assert max(maps.count(m) for m in maps) >= 3, "a chunk composing the maps of three earlier chunks"
    chains = [(plan, c) for plan, c in halos if c.chain]
    assert any(c.start // NODE != (c.stop - 1) // NODE and len(c.samples) > 1 for _, c in chains), "a chain across nodes, two samples"
    assert any(len(state_hops(plan.child_layout, c)) >= 7 for plan, c in chains), "a chain of seven hops"


@pytest.mark.slow
def test_the_driver_trains_a_gdn_hybrid_on_one_rank(tmp_path):
    from tests.dist_utils import forked_driver

    r = forked_driver(1, "--model", "tiny-gdn", "--steps", "2", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step     1" in r.stdout, r.stdout[-2000:]


def test_a_linear_kinds_bad_parameters_are_one_line_naming_the_setting():
    """Before any model is built: the kind's own rules (grouped values, the convolution within a
    recurrence block) and the generic ones (a positive integer), each naming the parameter."""
    from config import ModelConfig, SettingError
    from solver.cost import with_sparse_defaults

    tiny = ModelConfig.from_name("tiny-gdn")
    for params, message in (
        ({"v_heads": 6}, r"v_heads=6 is not a multiple of k_heads=4 \(each value head reads one key head\)"),
        ({"conv_kernel": 40}, r"conv_kernel=40 reaches past a recurrence block of block=16 tokens; use conv_kernel <= 17"),
        ({"block": 0}, r"block=0 is invalid; it takes an int > 0"),
        ({"k_heads": 2.5}, r"k_heads=2.5 is invalid; it takes an int > 0"),
        ({"state_dtype": "bfloat16"}, r"state_dtype='bfloat16' is not one of \['auto', 'float32', 'float64'\]"),
        ({"state_dtype": 3}, r"state_dtype=3 is invalid; it takes a name \(default 'auto'\)"),
    ):
        with pytest.raises(SettingError, match=r"sparse kind 'gated_delta': " + message):
            with_sparse_defaults(tiny.replace(sparse_params={**tiny.sparse_params, **params}))


def test_a_state_dtype_fla_lacks_is_refused_where_fla_would_run(monkeypatch):
    """fla's kernel carries float32 states: where it would run the layer (CUDA, fla installed, a
    dtype it runs, the backend not torch), state_dtype=float64 is a one-line error naming the
    setting; auto and float32 take fla; elsewhere the project's blockwise form runs every state
    dtype. (fla itself is held to the CPU path by tests/test_gpu.py on a GPU.)"""
    import torch

    import model.linear as linear
    from config import SettingError
    from model.linear import GatedDeltaNet

    monkeypatch.setattr(linear, "_fla_chunk", lambda: "fla")  # as where fla-core is installed
    layer = lambda state: GatedDeltaNet(16, 2, 4, 8, 8, state_dtype=state)  # noqa: E731
    assert layer("auto").fla_kernel(True, torch.bfloat16, "auto") == "fla"
    assert layer("float32").fla_kernel(True, torch.float32, "auto") == "fla"
    with pytest.raises(SettingError, match=r"state_dtype=float64: flash-linear-attention's chunked kernel carries float32 states"):
        layer("float64").fla_kernel(True, torch.bfloat16, "auto")
    assert layer("float64").fla_kernel(True, torch.bfloat16, "torch") is None  # the project's form
    assert layer("auto").fla_kernel(True, torch.float64, "auto") is None  # fla runs no float64
    assert layer("float64").fla_kernel(False, torch.float32, "auto") is None  # no CUDA
    assert layer("auto").state_dtype(torch.bfloat16) == torch.float32 and layer("auto").state_dtype(torch.float64) == torch.float64


def test_fla_is_passed_over_with_a_warning_where_it_refuses_to_train(monkeypatch, request):
    """fla-core refuses its gated backward on Hopper under Triton >= 3.4, < 3.7.1 without tilelang
    (seen on an H200 with Triton 3.6): there the layer takes the project's blockwise form, with a
    warning that names Triton's version and both ways out, rather than failing at its backward;
    with Triton 3.7.1, off Hopper, or with tilelang, fla's kernel is kept."""
    import importlib.util

    fla_utils = pytest.importorskip("fla.utils", reason="fla-core is not installed")
    pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is not installed")
    import model.linear as linear

    request.addfinalizer(linear.fla_refusal.cache_clear)  # answered once per process: asked afresh after each change

    def patch(owner, name, value):
        monkeypatch.setattr(owner, name, value)
        linear.fla_refusal.cache_clear()

    for name, value in (("IS_NVIDIA_HOPPER", True), ("TRITON_ABOVE_3_4_0", True), ("TRITON_ABOVE_3_7_1", False)):
        patch(fla_utils, name, value)
    real_find_spec = importlib.util.find_spec
    patch(importlib.util, "find_spec", lambda n, *a: None if n == "tilelang" else real_find_spec(n, *a))
    why = r"blockwise form: fla-core refuses .* Hopper under Triton .*upgrade Triton to >= 3.7.1 or pip install tilelang"
    with pytest.warns(RuntimeWarning, match=why):
        assert linear._fla_chunk() is None
    patch(fla_utils, "TRITON_ABOVE_3_7_1", True)
    assert linear.fla_refusal() is None and linear._fla_chunk() is not None
    patch(fla_utils, "TRITON_ABOVE_3_7_1", False)
    patch(fla_utils, "IS_NVIDIA_HOPPER", False)
    assert linear.fla_refusal() is None
    patch(fla_utils, "IS_NVIDIA_HOPPER", True)
    patch(importlib.util, "find_spec", lambda n, *a: object() if n == "tilelang" else real_find_spec(n, *a))
    assert linear.fla_refusal() is None


def test_states_travel_in_the_state_dtype_and_bf16_activations_keep_float32_states():
    """The layer's states and maps are in its state dtype whatever the activations: bf16
    activations with state_dtype auto give float32 final states and maps, and a chunk continued
    from its map-composed incoming state gives the whole sample's output (to bf16's rounding, as
    the state itself is float32); float64 states under float32 activations stay float64."""
    import torch

    from model.linear import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(16, 2, 4, 8, 8, block=4).to(torch.bfloat16)
    x = torch.randn(12, 16, dtype=torch.bfloat16)
    whole, finals, _ = layer(x, [0, 12])
    assert finals.dtype == torch.float32 and whole.dtype == torch.bfloat16
    mixed, z, a, b = layer._project(x)
    q, k, v, g, beta, _ = layer._inputs(mixed, a, b, [0, 12], None)
    m = layer.chunk_map(q[:5], k[:5], v[:5], g[:5], beta[:5])
    assert m.dtype == torch.float32 and m.shape == (4, 8, 16)
    state = m[..., 8:]  # the first chunk's state from zero is its map's B
    second, _ = layer._recurrence(q[5:], k[5:], v[5:], g[5:], beta[5:], [0, 7], state[None])
    o_whole, _ = layer._recurrence(q, k, v, g, beta, [0, 12], None)
    torch.testing.assert_close(second, o_whole[5:], rtol=2e-2, atol=2e-2)
    wide = GatedDeltaNet(16, 2, 4, 8, 8, block=4, state_dtype="float64")
    assert wide(torch.randn(6, 16), [0, 6])[1].dtype == torch.float64


def test_every_rank_of_a_ulysses_group_pays_every_block_of_its_samples():
    """The project's torch form loops over a recurrence's blocks, each iteration costing about the
    same whatever the heads (linear_block_latency): a Ulysses rank holds every sample of its
    group whole, so each of its ranks pays every block, the heads split or not, while the FLOPs
    divide. Samples of 50 and 9 tokens in blocks of 16: 4 + 1 blocks a rank and S layer pass;
    a map a halo chunk forms runs two more recurrences over its blocks."""
    from config import Cluster, CostsConfig, HardwareConfig, ModelConfig
    from solver import CostModel, make_plan, samples_from_lengths
    from solver.simulator import simulate

    cfg = ModelConfig.from_name("tiny-gdn")
    costs = CostsConfig(recompute="none", moe_all_to_all=False, optimizer=False)
    lat = 1e-3

    def step(plan, latency):
        return simulate(plan, CostModel(cfg, HardwareConfig(linear_block_latency=latency), costs=costs)).step_time

    sp2 = make_plan(samples_from_lengths([50, 9]), Cluster(2, 2, 32), CostModel(cfg, HardwareConfig(), costs=costs), "baseline")
    assert [g.size for g in sp2.child_layout.groups] == [2] and not sp2.child_layout.groups[0].halo
    passes = 3 * 3  # 3 S layers, forward once and backward twice
    assert step(sp2, lat) - step(sp2, 0.0) == pytest.approx(passes * 5 * lat)
    cost = CostModel(cfg, HardwareConfig(linear_block_latency=lat), costs=costs)
    assert cost.map_time([25]) - CostModel(cfg, HardwareConfig(), costs=costs).map_time([25]) == pytest.approx(2 * 2 * lat)
    windowed = ModelConfig.from_name("tiny")
    assert CostModel(windowed, HardwareConfig(linear_block_latency=lat)).block_time([50]) == pytest.approx([0.0])


@settings(max_examples=60)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    size=st.sampled_from([2, 3, 4, 8]),
    latency=st.sampled_from([0.0, 1e-3]),
)
def test_the_state_load_counts_what_the_transfer_list_moves(lengths, size, latency):
    """solver.reference.state_load counts, per rank of a state-passing group, the maps it sends or
    receives and the seconds of the maps its chunks form, per sample without listing them: the
    counts of solver.layout.state_transfers' list (every earlier map to every later non-empty
    chunk), and the map times of the chunks that send one."""
    import numpy as np

    from config import HardwareConfig, ModelConfig
    from solver import CostModel
    from solver.layout import Group, TokenLayout, Way, chunk_bounds, state_transfers
    from solver.reference import state_load

    cost = CostModel(ModelConfig.from_name("tiny-gdn"), HardwareConfig(linear_block_latency=latency))
    group = Group(4, size, tuple(range(len(lengths))), Way.HALO)
    length_of = dict(enumerate(lengths))
    maps, seconds = state_load(group, length_of, cost)
    got_in, got_out, want_s = np.zeros(size), np.zeros(size), np.zeros(size)
    formed = set()
    for t in state_transfers(TokenLayout((group,), length_of), group):
        got_in[t.dst - 4] += 1
        got_out[t.src - 4] += 1
        formed.add((t.src - 4, t.sample))
    for k, sid in formed:
        b = chunk_bounds(lengths[sid], size)
        want_s[k] += float(cost.map_time(b[k + 1] - b[k]))
    assert maps.tolist() == np.maximum(got_in, got_out).tolist()
    assert seconds == pytest.approx(want_s, rel=1e-12, abs=0)
