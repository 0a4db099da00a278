"""The built-in attention kinds, masks over keys priced by the (query, key) pairs they keep:
a sliding window (Mistral 7B's 4096) and chunks (Llama 4's local attention over chunks of 8192
tokens). model.attention registers their masks and kernels under the same names."""

from __future__ import annotations

import numpy as np

from ..flops import attention_flops, chunked_keys, sliding_window_keys
from . import register_sparse_cost

register_sparse_cost(
    "sliding_window",
    lambda n, cfg: attention_flops(sliding_window_keys(n, cfg.sparse_params["window"]), cfg),
    {"window": 4096},
    first_key=lambda q, p: np.maximum(np.asarray(q) - (p["window"] - 1), 0),  # the last W tokens
)
register_sparse_cost(
    "chunked",
    lambda n, cfg: attention_flops(chunked_keys(n, cfg.sparse_params["chunk"]), cfg),
    {"chunk": 8192},
    first_key=lambda q, p: np.asarray(q) - np.asarray(q) % p["chunk"],  # back to its chunk's start
)
