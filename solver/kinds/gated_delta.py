"""Gated DeltaNet (a linear kind): the gated delta rule over a state per value head, with a
short causal convolution before it (model.linear.GatedDeltaNet runs it). Its cost here: the
layer's FLOPs less its projections (those are token-wise work), its projections' parameters, its
Ulysses exchanges and its state passing. The defaults are Qwen3-Next-80B-A3B's linear layers
(2025: 16 key heads and 32 value heads of 128, a convolution of 4); fla's block (its chunk) of 64
tokens."""

from __future__ import annotations

import numpy as np

from config import ModelConfig

from ..flops import FLOPS_PER_MAC
from . import STATE_DTYPES, LinearKind, StatePassing, register_kind


def gated_delta_flops(
    lengths,
    hidden: int,
    k_heads: int,
    v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_kernel: int = 4,
    block: int = 64,
    parts: bool = False,
):
    """Forward FLOPs of one Gated DeltaNet layer (model.linear.GatedDeltaNet) per sample (a
    multiply-add counts 2): the input and output projections, the convolution, and per value head
    the blockwise recurrence (model.linear.blockwise; flash-linear-attention calls a block a
    chunk). Per block of C tokens with key size K and value size V: the products K K^T and Q K^T
    (2 C^2 K each), the masked scores times the deltas (2 C^2 V), the state's three products with
    the block (K S, Q S, K^T W: 2 C K V each), and the triangular solve for the deltas (C^2 V).
    Linear in the length for samples longer than a block. What state passing adds (each chunk's
    map, the same block work with K columns for V, and the scan over ranks) is priced where the
    chunks are known. parts=True: a dict of the terms
    (projections, convolution, the recurrence's matmuls, its solve), each per sample."""
    n = np.asarray(lengths, dtype=np.float64)
    qk, vd = k_heads * head_k_dim, v_heads * head_v_dim
    c = np.minimum(n, block)  # tokens of a (full) block: a sample shorter than a block is one block
    out = {
        "projections": n * FLOPS_PER_MAC * gated_delta_projections(hidden, k_heads, v_heads, head_k_dim, head_v_dim),
        "convolution": n * FLOPS_PER_MAC * conv_kernel * (2 * qk + vd),
        "recurrence_matmuls": n * v_heads * (4 * c * head_k_dim + 2 * c * head_v_dim + 6 * head_k_dim * head_v_dim),
        "recurrence_solve": n * v_heads * c * head_v_dim,
    }
    return out if parts else sum(out.values())


def gated_delta_map_flops(lengths, p: dict):
    """Forward FLOPs of the maps (A, B) of chunks of these lengths (model.linear.transition and the
    chunk's state from zero, per value head): the blockwise recurrence's matmuls and solve once
    with the values (B) and once with head_k_dim columns in their place (A)."""
    n = np.asarray(lengths, dtype=np.float64)
    c, dk = np.minimum(n, p["block"]), p["head_k_dim"]

    def recurrence(dv):
        return n * p["v_heads"] * (4 * c * dk + 2 * c * dv + 6 * dk * dv + c * dv)

    return recurrence(p["head_v_dim"]) + recurrence(dk)


def gated_delta_projections(hidden: int, k_heads: int, v_heads: int, head_k_dim: int, head_v_dim: int) -> int:
    """Parameters of a Gated DeltaNet layer's projections: in, to q and k (k_heads x head_k_dim
    each), v and the output gate (v_heads x head_v_dim each), the decay and strength inputs (one
    per value head); out, from the values back to the hidden size."""
    qk, vd = k_heads * head_k_dim, v_heads * head_v_dim
    return hidden * (2 * qk + 2 * vd + 2 * v_heads) + vd * hidden


def gated_delta_ulysses(p: dict) -> tuple[tuple[tuple[int, ...], int], tuple[tuple[int, ...], int]]:
    """A Gated DeltaNet layer's Ulysses exchanges (ulysses_parts), one element a head so that a
    value head and the key head it reads travel whole to one peer. In: the values (v_heads x
    head_v_dim elements, split by value head), the decay and strength inputs (v_heads each), then
    q and k by element: head_k_dim parts of k_heads each, element j of every key head (a group
    wider than the key heads replicates them, one key head each peer, as grouped-query attention
    replicates key/value heads). Out: the value heads' outputs (v_heads x head_v_dim)."""
    hk, hv = p["k_heads"], p["v_heads"]
    entry = (hv * p["head_v_dim"], hv, hv, *([hk] * (2 * p["head_k_dim"])))
    return (entry, 1), ((hv,), p["head_v_dim"])


def _gated_delta_args(cfg: ModelConfig) -> dict:
    p = cfg.sparse_params
    return {"k_heads": p["k_heads"], "v_heads": p["v_heads"], "head_k_dim": p["head_k_dim"], "head_v_dim": p["head_v_dim"]}


def gated_delta_problem(p: dict) -> str | None:
    """What is wrong with Gated DeltaNet parameters beyond their types, or None."""
    if p["v_heads"] % p["k_heads"]:
        return f"v_heads={p['v_heads']} is not a multiple of k_heads={p['k_heads']} (each value head reads one key head)"
    if p["state_dtype"] not in STATE_DTYPES:
        return (
            f"state_dtype={p['state_dtype']!r} is not one of {list(STATE_DTYPES)} (auto: float32, or the compute dtype where it is wider)"
        )
    if p["conv_kernel"] - 1 > p["block"]:
        return (
            f"conv_kernel={p['conv_kernel']} reaches past a recurrence block of block={p['block']} tokens; "
            f"use conv_kernel <= {p['block'] + 1}"
        )
    return None


# Gated DeltaNet (a linear kind): the defaults are Qwen3-Next-80B-A3B's linear layers (2025: 16 key
# heads and 32 value heads of 128, a convolution of 4); fla's block (its chunk) of 64 tokens. Its FLOPs here are
# the layer less its projections (those are token-wise work, `projections`).
register_kind(
    LinearKind(
        "gated_delta",
        lambda n, cfg: (lambda t: t["convolution"] + t["recurrence_matmuls"] + t["recurrence_solve"])(
            gated_delta_flops(
                n,
                cfg.hidden,
                **_gated_delta_args(cfg),
                conv_kernel=cfg.sparse_params["conv_kernel"],
                block=cfg.sparse_params["block"],
                parts=True,
            )
        ),
        {"k_heads": 16, "v_heads": 32, "head_k_dim": 128, "head_v_dim": 128, "conv_kernel": 4, "block": 64, "state_dtype": "auto"},
        projections=lambda cfg: gated_delta_projections(cfg.hidden, **_gated_delta_args(cfg)),
        check=gated_delta_problem,
        ulysses=gated_delta_ulysses,
        first_key=lambda q, p: np.maximum(np.asarray(q) - (p["conv_kernel"] - 1), 0),  # the convolution's reach
        passing=StatePassing(
            halo_elements=lambda p: 2 * p["k_heads"] * p["head_k_dim"] + p["v_heads"] * p["head_v_dim"],
            state_elements=lambda p: p["v_heads"] * p["head_k_dim"] * (p["head_k_dim"] + p["head_v_dim"]),
            map_flops=lambda n, cfg: gated_delta_map_flops(n, cfg.sparse_params),
            carried_elements=lambda p: p["v_heads"] * p["head_k_dim"] * p["head_v_dim"],
        ),
    )
)
