"""Plain torch references of the permute kernels (the CPU path, and the ground truth in tests).

gather_heads:  out[m, h, :] = x[rows[m], head_map[peers[m], h], :]
scatter_heads: out[rows[m], head_map[peers[m], h], :] = src[m, h, :]
"""

from __future__ import annotations

import contextlib

import torch


def gather_heads_ref(x: torch.Tensor, rows: torch.Tensor, peers: torch.Tensor, head_map: torch.Tensor) -> torch.Tensor:
    """x [N, Hx, D], rows [M], peers [M], head_map [P, Hs] -> [M, Hs, D].

    >>> x = torch.arange(12.).view(3, 2, 2)
    >>> gather_heads_ref(x, torch.tensor([2, 0]), torch.tensor([0, 1]), torch.tensor([[1], [0]])).shape
    torch.Size([2, 1, 2])
    """
    if rows.numel() == 0:
        return x.new_empty((0, head_map.shape[1], x.shape[2]))
    return x[rows.long().unsqueeze(1), head_map.long()[peers.long()]]


def scatter_heads_ref(
    src: torch.Tensor, rows: torch.Tensor, peers: torch.Tensor, head_map: torch.Tensor, n_out: int, out_heads: int
) -> torch.Tensor:
    """src [M, Hs, D] -> out [n_out, out_heads, D]; every output element is written by exactly one
    source element when (rows, head_map) cover the output (exchange plans guarantee it).

    >>> src = torch.ones(2, 1, 2)
    >>> scatter_heads_ref(src, torch.tensor([1, 0]), torch.tensor([0, 0]), torch.tensor([[0]]), 2, 1).shape
    torch.Size([2, 1, 2])
    """
    out = torch.empty((n_out, out_heads, src.shape[2]), dtype=src.dtype, device=src.device)
    if rows.numel():
        out[rows.long().unsqueeze(1), head_map.long()[peers.long()]] = src
    return out


@contextlib.contextmanager
def nan_poisoned_empty():
    """Inside the block torch.empty fills floating buffers with NaN, so an element a kernel
    forgets to write shows up in a comparison (used by the tests and experiments.gpu_check)."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    torch.empty = nan_empty
    try:
        yield
    finally:
        torch.empty = empty
