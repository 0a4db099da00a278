"""Kimi Delta Attention (a linear kind): the gated delta rule with a decay per key channel
(model.kda.KimiDeltaAttention runs it), as Kimi Linear's linear layers. Its cost here: the layer's
FLOPs less its projections (token-wise work), its projections' parameters (q, k, v, the strength,
the decay's and the output gate's low-rank pairs, the output), its Ulysses exchanges and its state
passing, which are the gated delta rule's with a decay input per key channel in place of one per
head. The defaults are Kimi-Linear-48B-A3B's linear layers (its public config.json: 32 heads of
128 for q, k and v, a short convolution of 4; the gates' bottleneck of one head's width);
flash-linear-attention's block (its chunk) of 64 tokens."""

from __future__ import annotations

import numpy as np

from ..flops import FLOPS_PER_MAC
from . import LinearKind, StatePassing, register_kind
from .gated_delta import gated_delta_problem


def kda_projections(hidden: int, k_heads: int, v_heads: int, head_k_dim: int, head_v_dim: int, gate_rank: int) -> int:
    """Parameters of a KDA layer's projections: in, to q and k (k_heads x head_k_dim each), v
    (v_heads x head_v_dim), the strength (one per value head) and the two gates' bottlenecks
    (gate_rank each); up, from the bottlenecks to the decay (v_heads x head_k_dim) and the output
    gate (v_heads x head_v_dim); out, from the values back to the hidden size."""
    qk, vd = k_heads * head_k_dim, v_heads * head_v_dim
    return hidden * (2 * qk + vd + v_heads + 2 * gate_rank) + gate_rank * (v_heads * head_k_dim + vd) + vd * hidden


def kda_recurrence(n, c, v_heads: int, dk: int, dv: int):
    """Forward FLOPs of the rule over samples of n tokens in blocks of c (model.kda._block), per
    value head: the channel-decayed products K K^T and Q K^T (3 C^2 K each: a product, a decay, a
    sum), the pairwise decays (2 C^2 K: a difference and an exp), the masked scores times the
    deltas (2 C^2 V), the state's three products with the block (2 C K V each), the triangular
    solve (C^2 V); every term per block of C tokens, so linear in the length past a block."""
    return n * v_heads * (8 * c * dk + 3 * c * dv + 6 * dk * dv)


def kda_flops(lengths, hidden: int, p: dict, parts: bool = False):
    """Forward FLOPs of one KDA layer per sample (a multiply-add counts 2): its projections, the
    convolution, the rule (kda_recurrence). parts=True: a dict of the terms, each per sample."""
    n = np.asarray(lengths, dtype=np.float64)
    hk, hv, dk, dv = p["k_heads"], p["v_heads"], p["head_k_dim"], p["head_v_dim"]
    c = np.minimum(n, p["block"])
    out = {
        "projections": n * FLOPS_PER_MAC * kda_projections(hidden, hk, hv, dk, dv, p["gate_rank"]),
        "convolution": n * FLOPS_PER_MAC * p["conv_kernel"] * (2 * hk * dk + hv * dv),
        "recurrence": kda_recurrence(n, c, hv, dk, dv),
    }
    return out if parts else sum(out.values())


def kda_map_flops(lengths, p: dict):
    """Forward FLOPs of the maps (A, B) of chunks of these lengths: the rule once with the values
    (B) and once with head_k_dim columns in their place (A, model.linear.transition)."""
    n = np.asarray(lengths, dtype=np.float64)
    c, dk = np.minimum(n, p["block"]), p["head_k_dim"]
    return kda_recurrence(n, c, p["v_heads"], dk, p["head_v_dim"]) + kda_recurrence(n, c, p["v_heads"], dk, dk)


def kda_ulysses(p: dict):
    """A KDA layer's Ulysses exchanges (solver.cost.ulysses_parts), one element a head: in, the
    values (v_heads x head_v_dim, by value head), the decay inputs (v_heads x head_k_dim, by value
    head), the strengths (v_heads), then q and k element by element (head_k_dim parts of k_heads,
    replicated over a group wider than the key heads); out, the value heads' outputs."""
    hk, hv = p["k_heads"], p["v_heads"]
    entry = (hv * p["head_v_dim"], hv * p["head_k_dim"], hv, *([hk] * (2 * p["head_k_dim"])))
    return (entry, 1), ((hv,), p["head_v_dim"])


register_kind(
    LinearKind(
        "kda",
        lambda n, cfg: (lambda t: t["convolution"] + t["recurrence"])(kda_flops(n, cfg.hidden, cfg.sparse_params, parts=True)),
        {
            "k_heads": 32,
            "v_heads": 32,
            "head_k_dim": 128,
            "head_v_dim": 128,
            "conv_kernel": 4,
            "block": 64,
            "gate_rank": 128,
            "state_dtype": "auto",
        },
        first_key=lambda q, p: np.maximum(np.asarray(q) - (p["conv_kernel"] - 1), 0),  # the convolution's reach
        check=gated_delta_problem,
        projections=lambda cfg: kda_projections(
            cfg.hidden, *(cfg.sparse_params[k] for k in ("k_heads", "v_heads", "head_k_dim", "head_v_dim", "gate_rank"))
        ),
        ulysses=kda_ulysses,
        passing=StatePassing(
            halo_elements=lambda p: 2 * p["k_heads"] * p["head_k_dim"] + p["v_heads"] * p["head_v_dim"],
            state_elements=lambda p: p["v_heads"] * p["head_k_dim"] * (p["head_k_dim"] + p["head_v_dim"]),
            map_flops=lambda n, cfg: kda_map_flops(n, cfg.sparse_params),
            carried_elements=lambda p: p["v_heads"] * p["head_k_dim"] * p["head_v_dim"],
        ),
    )
)
