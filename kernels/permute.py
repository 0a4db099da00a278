"""Fused row-permute + head split/merge kernels around the all-to-all.

One read and one write per element: `gather_heads` packs (rows of the local tensor, the heads of
each destination peer's slice) into the contiguous send buffer; `scatter_heads` unpacks the
receive buffer into the output's rows and head slices. Both take a plan's plain integer arrays.
"""

from __future__ import annotations

import torch

from ._triton import tl, triton
from .reference import gather_heads_ref, scatter_heads_ref


@triton.jit
def _tile(rows_ptr, peers_ptr, map_ptr, M, HS, D, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_H, BLOCK_D] tile: packed-side offsets, the row and head of
    every element on the other side, and the mask."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m_ok = m < M
    rows = tl.load(rows_ptr + m, mask=m_ok, other=0).to(tl.int64)
    peers = tl.load(peers_ptr + m, mask=m_ok, other=0).to(tl.int64)
    mh_ok = m_ok[:, None] & (h < HS)[None, :]
    heads = tl.load(map_ptr + peers[:, None] * HS + h[None, :], mask=mh_ok, other=0).to(tl.int64)
    mask = mh_ok[:, :, None] & (d < D)[None, None, :]
    packed = (m.to(tl.int64)[:, None, None] * HS + h[None, :, None]) * D + d[None, None, :]
    return packed, rows[:, None, None], heads[:, :, None], d[None, None, :], mask


@triton.jit
def _gather_heads_kernel(
    x_ptr, out_ptr, rows_ptr, peers_ptr, map_ptr, M, HX, HS, D, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr
):
    packed, rows, heads, d, mask = _tile(rows_ptr, peers_ptr, map_ptr, M, HS, D, BLOCK_M, BLOCK_H, BLOCK_D)
    val = tl.load(x_ptr + (rows * HX + heads) * D + d, mask=mask)
    tl.store(out_ptr + packed, val, mask=mask)


@triton.jit
def _scatter_heads_kernel(
    src_ptr, out_ptr, rows_ptr, peers_ptr, map_ptr, M, HO, HS, D, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr
):
    packed, rows, heads, d, mask = _tile(rows_ptr, peers_ptr, map_ptr, M, HS, D, BLOCK_M, BLOCK_H, BLOCK_D)
    val = tl.load(src_ptr + packed, mask=mask)
    tl.store(out_ptr + (rows * HO + heads) * D + d, val, mask=mask)


def _blocks(hs: int, d: int) -> tuple[int, int, int]:
    block_d = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(hs), max(1, 2048 // block_d))
    block_m = max(1, min(64, 4096 // (block_h * block_d)))
    return block_m, block_h, block_d


def _check(x: torch.Tensor, rows: torch.Tensor, peers: torch.Tensor, head_map: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"expected a [rows, heads, head_dim] tensor, got shape {tuple(x.shape)}")
    if rows.shape != peers.shape or rows.dim() != 1:
        raise ValueError(f"rows {tuple(rows.shape)} and peers {tuple(peers.shape)} must be matching 1-D index arrays")
    if head_map.dim() != 2:
        raise ValueError(f"head_map must be [peers, heads], got shape {tuple(head_map.shape)}")


def _launch(kernel, src: torch.Tensor, out_shape, other_heads: int, rows, peers, head_map) -> torch.Tensor:
    """Allocate the output and run `kernel` over [M rows, Hs heads] tiles (nothing to do for M = 0)."""
    _check(src, rows, peers, head_map)
    src = src.contiguous()
    m, hs, d = rows.numel(), head_map.shape[1], src.shape[2]
    out = torch.empty(out_shape, dtype=src.dtype, device=src.device)
    if m == 0 or hs == 0:
        return out
    bm, bh, bd = _blocks(hs, d)
    grid = (triton.cdiv(m, bm), triton.cdiv(hs, bh))
    kernel[grid](
        src, out, rows.contiguous(), peers.contiguous(), head_map.contiguous(), m, other_heads, hs, d, BLOCK_M=bm, BLOCK_H=bh, BLOCK_D=bd
    )
    return out


def gather_heads_triton(x: torch.Tensor, rows: torch.Tensor, peers: torch.Tensor, head_map: torch.Tensor) -> torch.Tensor:
    """out[m, h, :] = x[rows[m], head_map[peers[m], h], :]; x [N, Hx, D] -> [M, Hs, D]."""
    return _launch(_gather_heads_kernel, x, (rows.numel(), head_map.shape[1], x.shape[2]), x.shape[1], rows, peers, head_map)


def scatter_heads_triton(
    src: torch.Tensor, rows: torch.Tensor, peers: torch.Tensor, head_map: torch.Tensor, n_out: int, out_heads: int
) -> torch.Tensor:
    """out[rows[m], head_map[peers[m], h], :] = src[m, h, :]; src [M, Hs, D] -> [n_out, out_heads, D]."""
    return _launch(_scatter_heads_kernel, src, (n_out, out_heads, src.shape[2]), out_heads, rows, peers, head_map)


PACK_BACKENDS = ("auto", "triton", "torch")


def resolve_pack_backend(backend: str, device: torch.device) -> str:
    if backend not in PACK_BACKENDS:
        raise ValueError(f"pack backend {backend!r} is not one of {PACK_BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def gather_heads(x, rows, peers, head_map, backend: str = "auto") -> torch.Tensor:
    """Pack: x [N, Hx, D] -> [M, Hs, D] with out[m, h] = x[rows[m], head_map[peers[m], h]].

    >>> x = torch.randn(5, 4, 8)
    >>> rows, peers = torch.tensor([4, 0, 1]), torch.tensor([0, 0, 1])
    >>> hmap = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    >>> torch.equal(gather_heads(x, rows, peers, hmap, "triton"), gather_heads(x, rows, peers, hmap, "torch"))
    True
    """
    if resolve_pack_backend(backend, x.device) == "triton":
        return gather_heads_triton(x, rows, peers, head_map)
    return gather_heads_ref(x, rows, peers, head_map)


def scatter_heads(src, rows, peers, head_map, n_out: int, out_heads: int, backend: str = "auto") -> torch.Tensor:
    """Unpack: src [M, Hs, D] -> [n_out, out_heads, D] with out[rows[m], head_map[peers[m], h]] = src[m, h]."""
    if resolve_pack_backend(backend, src.device) == "triton":
        return scatter_heads_triton(src, rows, peers, head_map, n_out, out_heads)
    return scatter_heads_ref(src, rows, peers, head_map, n_out, out_heads)
