"""FLOP counts of attention over samples: the (query, key) pairs each mask keeps and the two
matmuls over them, shared by the cost model and the attention kinds (solver.kinds)."""

from __future__ import annotations

import numpy as np

from config import ModelConfig

FLOPS_PER_MAC = 2.0  # a multiply-accumulate is two FLOPs: a [n, k] x [k, m] matmul costs 2 n k m


def causal_keys(length):
    """Number of (query, key) pairs of causal attention over a sample."""
    n = np.asarray(length, dtype=np.float64)
    return n * (n + 1) / 2


def sliding_window_keys(length, window: int):
    n = np.asarray(length, dtype=np.float64)
    w = float(window)
    return np.where(n <= w, n * (n + 1) / 2, w * (w + 1) / 2 + (n - w) * w)


def chunked_keys(length, chunk: int):
    n = np.asarray(length, dtype=np.float64)
    full, rest = np.floor(n / chunk), np.mod(n, chunk)
    return full * chunk * (chunk + 1) / 2 + rest * (rest + 1) / 2


def attention_flops(pairs, cfg: ModelConfig):
    """Forward FLOPs of QK^T (at the q/k head size) and PV (at the value head size) over `pairs`
    (query, key) pairs, all heads."""
    return FLOPS_PER_MAC * cfg.n_heads * (cfg.head_dim + cfg.v_dim) * np.asarray(pairs, dtype=np.float64)
