"""Token-wise layers against written-out yardsticks: the MoE's sorted dispatch, rotary tables."""

import torch
import torch.nn.functional as F

from model.layers import MoE, Rotary


def test_moe_sorted_dispatch_matches_a_per_token_sum_over_its_experts():
    torch.manual_seed(0)
    moe = MoE(hidden=6, ffn=5, n_experts=4, top_k=2).double()
    x = torch.randn(13, 6, dtype=torch.float64)
    out, _ = moe(x)
    probs = torch.softmax(moe.router(x), dim=-1)
    for t in range(x.shape[0]):
        w, e = probs[t].topk(2)
        w = w / w.sum()
        want = sum(w[i] * (F.silu(x[t] @ moe.experts.w1[e[i]]) * (x[t] @ moe.experts.w3[e[i]])) @ moe.experts.w2[e[i]] for i in range(2))
        torch.testing.assert_close(out[t], want, rtol=1e-12, atol=1e-12)
    # an expert no token is routed to gets no gradient through the output, the others do
    moe.router.weight.data[3] = -50.0  # on positive inputs: the lowest logit by far
    out, _ = moe(x.abs())
    out.sum().backward()
    assert moe.experts.w1.grad[3].abs().sum() == 0 and all(moe.experts.w1.grad[e].abs().sum() > 0 for e in range(3))


def test_rotary_tables_rotate_each_pair_by_its_position_angle():
    """(x1 + i x2) e^{i p / theta^(j / half)}: the complex form, per token, in fp64; from table
    slices (ranges), from a gather (positions only), and past the first table's size."""
    torch.manual_seed(0)
    theta, d = 1e4, 8
    for lengths in ([5, 3, 1], [1500, 4]):
        positions = torch.cat([torch.arange(n) for n in lengths])
        x = torch.randn(len(positions), 3, d, dtype=torch.float64)
        freq = theta ** -(torch.arange(d // 2, dtype=torch.float64) / (d // 2))
        z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * torch.polar(
            torch.ones(1, dtype=torch.float64), positions[:, None, None] * freq
        )
        want = torch.cat([z.real, z.imag], dim=-1)
        by_slices = Rotary(positions, d, theta, [(0, n) for n in lengths])(x)
        by_gather = Rotary(positions, d, theta)(x)
        torch.testing.assert_close(by_slices, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(by_slices, by_gather)
    # fp32 tables are the fp64 angles' cos/sin rounded once (not computed in fp32: large positions)
    r = Rotary(positions, d, theta)
    assert all(torch.equal(a, b.float()) for a, b in zip(r.tables(torch.float32), r.tables(torch.float64)))


def test_memory_estimate_counts_the_models_own_parameters():
    """experiments.memory's parameter bytes are 4 x the parameters the torch model holds, and
    sharding divides the states over the ranks."""
    from config import ModelConfig
    from experiments.common.memory import estimate
    from model import HybridMoE

    for name in ("tiny", "tiny-gqa"):
        cfg = ModelConfig.from_name(name)
        n = sum(p.numel() for p in HybridMoE(cfg).parameters())
        assert estimate(cfg, 1, 1, "none")["parameters (fp32)"] == 4 * n
        assert estimate(cfg, 8, 1, "fsdp")["AdamW state"] == 8 * n / 8
    cfg = ModelConfig.from_name("tiny")
    assert estimate(cfg, 8, 64, recompute="full")["activations"] < estimate(cfg, 8, 64, recompute="none")["activations"]
