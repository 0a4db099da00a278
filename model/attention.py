"""Varlen attention behind one interface, and the registry of sparse-attention kinds.

    attn(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D], cu_seqlens [n+1] int32, max_seqlen) -> [T, H, D]

Backends: `flash` (flash-attn's flash_attn_varlen_func, CUDA only, imported lazily) and `torch`
(runs anywhere; the reference). `auto` picks flash when CUDA and flash-attn are present.
A sparse kind is registered by name with a mask (for the torch path), an optional flash-attn
mapping, and its FLOPs, which solver.cost then prices for the solvers and the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from solver.cost import register_sparse_cost, sparse_cost

BACKENDS = ("auto", "torch", "flash", "kernel")  # kernel: a sparse kind's own fn where it has one, else torch

MaskFn = Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor]  # (q_pos [Lq,1], k_pos [1,Lk], params) -> allowed


@dataclass(frozen=True)
class SparseKind:
    name: str
    mask: MaskFn  # which keys a query may see (on top of causality)
    flash_window: Callable[[dict], tuple[int, int]] | None = None  # flash-attn window_size, if it is a window
    split_chunks: Callable[[dict], int] | None = None  # attention restricted to aligned chunks of this size
    fn: Callable | None = None  # a kernel of its own: fn(q, k, v, cu_seqlens, max_seqlen, params) -> out


_SPARSE: dict[str, SparseKind] = {}


def register_sparse_attention(
    name: str, mask: MaskFn, flops=None, flash_window=None, split_chunks=None, fn=None, params: dict | None = None, overwrite: bool = False
) -> None:
    """Register a sparse-attention kind by name.

    mask(q_pos, k_pos, params) -> allowed: the pattern (the torch reference path uses it);
    flops(lengths, model_config) -> forward FLOPs per sample: picked up by the solvers and the
    simulator through solver.cost (None: the kind is already priced there, as the built-in kinds
    are); fn(q, k, v, cu_seqlens, max_seqlen, params): an optional kernel of its own, used
    instead of the reference on every backend but "torch"; params: the kind's parameters and
    their defaults (sparse_params is checked against them)."""
    if name in _SPARSE and not overwrite:
        raise ValueError(f"sparse kind {name!r} is already registered; pass overwrite=True to replace it")
    if flops is None:
        sparse_cost(name)  # raises, naming the priced kinds, unless solver.cost prices it
    else:
        register_sparse_cost(name, flops, params, overwrite=True)
    _SPARSE[name] = SparseKind(name, mask, flash_window, split_chunks, fn)


def sparse_kind(name: str) -> SparseKind:
    if name not in _SPARSE:
        raise ValueError(f"unknown sparse kind {name!r}; registered: {sorted(_SPARSE)}")
    return _SPARSE[name]


# the built-in kinds: priced in solver.cost, their patterns here
register_sparse_attention("sliding_window", mask=lambda qp, kp, p: (qp - kp) < p["window"], flash_window=lambda p: (p["window"] - 1, 0))
register_sparse_attention("chunked", mask=lambda qp, kp, p: (qp // p["chunk"]) == (kp // p["chunk"]), split_chunks=lambda p: p["chunk"])


# ----- torch reference -------------------------------------------------------------------------
def torch_varlen_attention(q, k, v, cu_seqlens, max_seqlen=None, mask: MaskFn | None = None, params: dict | None = None):
    """Causal varlen attention, optionally restricted by a sparse mask; GQA by repeating K/V heads.

    >>> q = torch.randn(5, 4, 8); kv = torch.randn(5, 2, 8)
    >>> torch_varlen_attention(q, kv, kv, torch.tensor([0, 3, 5])).shape
    torch.Size([5, 4, 8])
    """
    h, hkv = q.shape[1], k.shape[1]
    if h % hkv:
        raise ValueError(f"query heads {h} are not a multiple of key/value heads {hkv}")
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(q.shape[2])
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        if b == a:
            continue
        qs = q[a:b]
        ks = k[a:b].repeat_interleave(h // hkv, dim=1)
        vs = v[a:b].repeat_interleave(h // hkv, dim=1)
        pos = torch.arange(b - a, device=q.device)
        allowed = pos[:, None] >= pos[None, :]
        if mask is not None:
            allowed = allowed & mask(pos[:, None], pos[None, :], params or {})
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        s = s.masked_fill(~allowed, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vs)
    return out


# ----- flash-attn ------------------------------------------------------------------------------
def _flash_fn():
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: PLC0415  (optional GPU extra)
    except ImportError as e:
        raise RuntimeError("the flash backend needs flash-attn (pip install -r requirements-gpu.txt on a CUDA machine)") from e
    return flash_attn_varlen_func


def flash_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        _flash_fn()
    except RuntimeError:
        return False
    return True


def flash_varlen_attention(q, k, v, cu_seqlens, max_seqlen, window: tuple[int, int] = (-1, -1), fn=None):
    """flash_attn_varlen_func with causal=True and `window_size` ((-1, -1): full causal)."""
    fn = fn or _flash_fn()
    cu = cu_seqlens.to(torch.int32)
    return fn(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), causal=True, window_size=window)


def _chunk_cu(cu_seqlens: torch.Tensor, chunk: int) -> tuple[torch.Tensor, int]:
    """Refine cu_seqlens so every sample is cut into aligned chunks of `chunk` tokens."""
    bounds = []
    cu = cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        bounds.extend(range(a, b, chunk))
    bounds.append(cu[-1])
    return torch.tensor(bounds, dtype=torch.int32, device=cu_seqlens.device), chunk


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "flash" if device.type == "cuda" and flash_available() else "kernel"
    return backend


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, kind: str = "full", params: dict | None = None, backend: str = "auto", flash_fn=None):
    """Full (causal) or sparse attention of `kind` over packed samples. [T, H, D] -> [T, H, D].

    >>> q = torch.randn(9, 4, 8)
    >>> varlen_attention(q, q, q, torch.tensor([0, 4, 9]), 5, "sliding_window", {"window": 2}, "torch").shape
    torch.Size([9, 4, 8])
    """
    if flash_fn is None:
        backend = resolve_backend(backend, q.device)
    if kind == "full":
        if backend == "flash" or flash_fn is not None:
            return flash_varlen_attention(q, k, v, cu_seqlens, max_seqlen, fn=flash_fn)
        return torch_varlen_attention(q, k, v, cu_seqlens)
    sk = sparse_kind(kind)
    params = params or {}
    if sk.fn is not None and (backend != "torch" or flash_fn is not None):
        return sk.fn(q, k, v, cu_seqlens, max_seqlen, params)
    if sk.split_chunks is not None:  # chunked attention is full causal attention on chunks
        cu, mx = _chunk_cu(cu_seqlens, sk.split_chunks(params))
        return varlen_attention(q, k, v, cu, min(mx, max_seqlen), "full", None, backend, flash_fn)
    if (backend == "flash" or flash_fn is not None) and sk.flash_window is not None:
        return flash_varlen_attention(q, k, v, cu_seqlens, max_seqlen, sk.flash_window(params), fn=flash_fn)
    return torch_varlen_attention(q, k, v, cu_seqlens, mask=sk.mask, params=params)
