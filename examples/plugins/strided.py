"""A sparse-attention kind of your own, as a plugin: a local window plus every stride-th key back
to the sample's start (a strided pattern), registered with its mask and its FLOPs. Give it to
any entry point with --plugin (it is imported before the settings are read, in every torchrun
rank), then name the kind:

    python -m experiments.ablation --plugin examples/plugins/strided.py --sparse-kind strided
    torchrun --standalone --nproc-per-node 4 -m experiments.train --plugin examples/plugins/strided.py \\
        --sparse-kind strided --sparse-params local=8 stride=4 --gpus-per-node 2

model.attention.check_sparse_flops("strided", cfg) holds its FLOPs to the pairs its mask allows
(tests/test_plugins.py runs it, the ablation and four ranks of the driver with this file).
"""

import numpy as np

from model import register_sparse_attention
from solver.cost import attention_flops, sliding_window_keys


def strided_keys(length, local: int, stride: int):
    """(query, key) pairs of causal attention over a sample of `length` tokens that keep the last
    `local` keys and every key k with (k + 1) % stride == 0: the window's pairs, plus, for each
    query q >= local, the strided keys in [0, q - local], floor((q - local + 1) / stride) of them,
    summed in closed form over m = q - local + 1 = 1 .. length - local."""
    n = np.asarray(length, dtype=np.float64)
    m = np.maximum(n - local, 0)  # the queries that reach past their window
    t = np.floor(m / stride)
    return sliding_window_keys(n, local) + stride * t * (t - 1) / 2 + t * (m - stride * t + 1)


register_sparse_attention(
    "strided",
    mask=lambda q_pos, k_pos, p: ((q_pos - k_pos) < p["local"]) | ((k_pos + 1) % p["stride"] == 0),
    flops=lambda lengths, cfg: attention_flops(strided_keys(lengths, cfg.sparse_params["local"], cfg.sparse_params["stride"]), cfg),
    params={"local": 4096, "stride": 64},
    first_key=None,  # not local: a query sees strided keys back to its sample's start, so no halo child serves it
)
