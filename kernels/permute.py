"""Fused row-permute + head split/merge kernels around the all-to-all.

One read and one write per element: `gather_heads` packs (rows of the local tensor, the heads of
each destination peer's slice) into the contiguous send buffer; `scatter_heads` unpacks the
receive buffer into the output's rows and head slices. Both take a plan's plain integer arrays.

A program moves one [BLOCK_M rows, BLOCK_H heads, head_dim] tile. The tile is sized so every
thread keeps four 16-byte vectors in flight when a head's row is 16-byte aligned (head_dim x
element size a multiple of 16: the bf16 and fp16 data path is then LDG.E.128 / STG.E.128), and
16 scalar elements otherwise; BLOCK_H divides the heads a peer gets, so no lane idles on a padded
head; offsets are 32-bit unless a tensor holds 2^31 elements or more. kernels.machine_code
compiles these kernels for sm_80/90/100 and reads the registers, spills and vector widths back.
"""

from __future__ import annotations

import math

import torch

from ._triton import tl, triton
from .reference import gather_heads_ref, scatter_heads_ref

NUM_WARPS = 4
VECTORS_PER_THREAD = 4  # 16-byte vectors in flight per thread on the aligned path
SCALARS_PER_THREAD = 16  # elements per thread when a head's row is not 16-byte aligned
INT32_LIMIT = 2**31  # tensors with fewer elements index in 32 bits


@triton.jit
def _tile(rows_ptr, peers_ptr, map_ptr, M, HS, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
          WIDE: tl.constexpr):  # fmt: skip
    """This program's [BLOCK_M, BLOCK_H, BLOCK_D] tile: packed-side offsets, the row and head of
    every element on the other side, and the mask (rows past M; lanes past D when D is not a power
    of two). BLOCK_H divides HS, so every head lane is a real head."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m_ok = m < M
    rows = tl.load(rows_ptr + m, mask=m_ok, other=0)
    peers = tl.load(peers_ptr + m, mask=m_ok, other=0)
    heads = tl.load(map_ptr + peers[:, None] * HS + h[None, :], mask=m_ok[:, None], other=0)
    if WIDE:
        m, rows, heads = m.to(tl.int64), rows.to(tl.int64), heads.to(tl.int64)
    else:
        rows, heads = rows.to(tl.int32), heads.to(tl.int32)
    if BLOCK_D == D:
        mask = m_ok[:, None, None]
    else:
        mask = m_ok[:, None, None] & (d < D)[None, None, :]
    packed = (m[:, None, None] * HS + h[None, :, None]) * D + d[None, None, :]
    return packed, rows[:, None, None], heads[:, :, None], d[None, None, :], mask


@triton.jit
def _gather_heads_kernel(x_ptr, out_ptr, rows_ptr, peers_ptr, map_ptr, M, HX, HS, D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr):  # fmt: skip
    packed, rows, heads, d, mask = _tile(rows_ptr, peers_ptr, map_ptr, M, HS, D, BLOCK_M, BLOCK_H, BLOCK_D, WIDE)
    val = tl.load(x_ptr + (rows * HX + heads) * D + d, mask=mask)
    tl.store(out_ptr + packed, val, mask=mask)


@triton.jit
def _scatter_heads_kernel(src_ptr, out_ptr, rows_ptr, peers_ptr, map_ptr, M, HO, HS, D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, WIDE: tl.constexpr):  # fmt: skip
    packed, rows, heads, d, mask = _tile(rows_ptr, peers_ptr, map_ptr, M, HS, D, BLOCK_M, BLOCK_H, BLOCK_D, WIDE)
    val = tl.load(src_ptr + packed, mask=mask)
    tl.store(out_ptr + (rows * HO + heads) * D + d, val, mask=mask)


KERNELS = {"gather": _gather_heads_kernel, "scatter": _scatter_heads_kernel}


def vector_elements(head_dim: int, element_size: int) -> int:
    """Elements of one 16-byte access when a head's row is 16-byte aligned, else 1 (scalar)."""
    return 16 // element_size if (head_dim * element_size) % 16 == 0 and element_size <= 16 else 1


def tile_shape(heads: int, head_dim: int, element_size: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_H, BLOCK_D) of one program for `heads` heads per peer of `head_dim`.

    >>> tile_shape(4, 128, 2)  # bf16: 128 threads x 4 vectors of 8 elements = 4096 elements
    (8, 4, 128)
    >>> tile_shape(3, 97, 2)  # not aligned: 16 scalars per thread; 3 heads in programs of 1 head
    (16, 1, 128)
    """
    vec = vector_elements(head_dim, element_size)
    per_thread = VECTORS_PER_THREAD * vec if vec > 1 else SCALARS_PER_THREAD
    tile = NUM_WARPS * 32 * per_thread
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(heads & -heads, max(1, tile // block_d))  # the largest power of two dividing heads, within the tile
    return max(1, tile // (block_h * block_d)), block_h, block_d


def _check(x: torch.Tensor, rows: torch.Tensor, peers: torch.Tensor, head_map: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"expected a [rows, heads, head_dim] tensor, got shape {tuple(x.shape)}")
    if rows.shape != peers.shape or rows.dim() != 1:
        raise ValueError(f"rows {tuple(rows.shape)} and peers {tuple(peers.shape)} must be matching 1-D index arrays")
    if head_map.dim() != 2:
        raise ValueError(f"head_map must be [peers, heads], got shape {tuple(head_map.shape)}")


def launch_spec(op: str, src: torch.Tensor, out: torch.Tensor, rows, peers, head_map):
    """(kernel, grid, positional args, meta-parameters) of one launch of `op` ("gather" or
    "scatter"): what _launch runs, and what kernels.machine_code compiles for a GPU target with
    the specialization Triton's launcher derives from these very arguments."""
    m, hs, d = rows.numel(), head_map.shape[1], src.shape[2]
    other_heads = src.shape[1] if op == "gather" else out.shape[1]
    bm, bh, bd = tile_shape(hs, d, src.element_size())
    wide = max(src.numel(), out.numel()) >= INT32_LIMIT
    grid = (triton.cdiv(m, bm), hs // bh)
    args = (src, out, rows, peers, head_map, m, other_heads, hs)
    meta = {"D": d, "BLOCK_M": bm, "BLOCK_H": bh, "BLOCK_D": bd, "WIDE": wide, "num_warps": NUM_WARPS}
    return KERNELS[op], grid, args, meta


def _launch(op: str, src: torch.Tensor, out_shape, rows, peers, head_map) -> torch.Tensor:
    """Allocate the output and run `op` over [M rows, Hs heads] tiles (nothing to do for M = 0)."""
    _check(src, rows, peers, head_map)
    src = src.contiguous()
    out = torch.empty(out_shape, dtype=src.dtype, device=src.device)
    if rows.numel() == 0 or head_map.shape[1] == 0:
        return out
    kernel, grid, args, meta = launch_spec(op, src, out, rows.contiguous(), peers.contiguous(), head_map.contiguous())
    kernel[grid](*args, **meta)
    return out


def gather_heads_triton(x: torch.Tensor, rows: torch.Tensor, peers: torch.Tensor, head_map: torch.Tensor) -> torch.Tensor:
    """out[m, h, :] = x[rows[m], head_map[peers[m], h], :]; x [N, Hx, D] -> [M, Hs, D]."""
    return _launch("gather", x, (rows.numel(), head_map.shape[1], x.shape[2]), rows, peers, head_map)


def scatter_heads_triton(
    src: torch.Tensor, rows: torch.Tensor, peers: torch.Tensor, head_map: torch.Tensor, n_out: int, out_heads: int
) -> torch.Tensor:
    """out[rows[m], head_map[peers[m], h], :] = src[m, h, :]; src [M, Hs, D] -> [n_out, out_heads, D]."""
    return _launch("scatter", src, (n_out, out_heads, src.shape[2]), rows, peers, head_map)


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


def gather_rows(x: torch.Tensor, rows: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """x [n, ...] -> x[rows] [m, ...] through the pack kernel, each row one wide head (one read and
    one write a row): the experts' slot gathers and the halos' packing.

    >>> x = torch.randn(5, 3, 4)
    >>> torch.equal(gather_rows(x, torch.tensor([4, 0, 0]), "triton"), x[[4, 0, 0]])
    True
    """
    heads = torch.zeros(1, 1, dtype=torch.int32, device=x.device)
    peers = torch.zeros(rows.numel(), dtype=torch.int32, device=x.device)
    flat = x.reshape(x.shape[0], 1, math.prod(x.shape[1:]))
    return gather_heads(flat, rows, peers, heads, backend).reshape(rows.numel(), *x.shape[1:])


def scatter_heads(src, rows, peers, head_map, n_out: int, out_heads: int, backend: str = "auto") -> torch.Tensor:
    """Unpack: src [M, Hs, D] -> [n_out, out_heads, D] with out[rows[m], head_map[peers[m], h]] = src[m, h]."""
    if resolve_pack_backend(backend, src.device) == "triton":
        return scatter_heads_triton(src, rows, peers, head_map, n_out, out_heads)
    return scatter_heads_ref(src, rows, peers, head_map, n_out, out_heads)
