"""Varlen attention behind one interface, and the registry of sparse-attention kinds.

    attn(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D], cu_seqlens [n+1] int32, max_seqlen) -> [T, H, D]

Backends: `flash` (flash-attn's flash_attn_varlen_func, CUDA only, imported lazily), `varlen`
(torch's own torch.nn.attention.varlen.varlen_attn, CUDA only: no extra package) and `torch`
(runs anywhere, memory-bounded; the reference). `auto` picks flash, then varlen on CUDA.
A sparse kind is registered by name with a mask (for the torch path), an optional flash-attn
mapping, and its FLOPs, which solver.cost then prices for the solvers and the simulator.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from solver.cost import attention_flops, register_sparse_cost, sparse_cost

BACKENDS = ("auto", "torch", "flash", "varlen", "kernel")  # kernel: a sparse kind's own fn where it has one, else torch

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
    name: str,
    mask: MaskFn,
    flops=None,
    flash_window=None,
    split_chunks=None,
    fn=None,
    params: dict | None = None,
    overwrite: bool = False,
    first_key=None,
) -> None:
    """Register a sparse-attention kind by name.

    mask(q_pos, k_pos, params) -> allowed: the pattern (the torch reference path uses it);
    flops(lengths, model_config) -> forward FLOPs per sample: picked up by the solvers and the
    simulator through solver.cost (None: the kind is already priced there, as the built-in kinds
    are); fn(q, k, v, cu_seqlens, max_seqlen, params): an optional kernel of its own, used
    instead of the reference on every backend but "torch"; params: the kind's parameters and
    their defaults (sparse_params is checked against them); first_key(query positions, params):
    for a local kind, the first key each query may see (halo children need it; the mask must
    allow nothing before it)."""
    if name in _SPARSE and not overwrite:
        raise ValueError(f"sparse kind {name!r} is already registered; pass overwrite=True to replace it")
    if flops is None:
        sparse_cost(name)  # raises, naming the priced kinds, unless solver.cost prices it
    else:
        register_sparse_cost(name, flops, params, overwrite=True, first_key=first_key)
    _SPARSE[name] = SparseKind(name, mask, flash_window, split_chunks, fn)


def mask_pairs(name: str, length: int, params: dict) -> int:
    """(query, key) pairs a sample of `length` tokens keeps under a kind's mask and causality,
    counted from the mask itself, position by position (a yardstick for its FLOPs: small lengths).

    >>> mask_pairs("sliding_window", 5, {"window": 2})
    9
    """
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    return int(((k <= q) & sparse_kind(name).mask(q, k, params)).sum())


def check_sparse_flops(name: str, cfg, lengths=(1, 2, 3, 7, 31, 64, 97, 200)) -> None:
    """Hold a registered kind's FLOPs (what the solvers and the simulator price it by) to its mask:
    for each length, its flops must be attention_flops of the pairs mask_pairs counts (the kind's
    parameters: cfg's, its defaults filling in). ValueError naming the first length where they
    differ, with both counts."""
    cfg = cfg.replace(sparse_kind=name, sparse_params=sparse_cost(name).resolve(cfg.sparse_params if cfg.sparse_kind == name else {}))
    got = sparse_cost(name).flops(np.asarray(lengths, dtype=np.float64), cfg)
    per_pair = float(attention_flops([1.0], cfg)[0])
    for n, flops in zip(lengths, np.asarray(got, dtype=np.float64).tolist()):
        pairs = mask_pairs(name, n, cfg.sparse_params)
        if not math.isclose(flops, pairs * per_pair, rel_tol=1e-9):
            raise ValueError(
                f"sparse kind {name!r}: its flops count {flops / per_pair:g} (query, key) pairs for a sample of {n} tokens, "
                f"its mask keeps {pairs} (params {cfg.sparse_params}): the solvers would price another pattern than it runs"
            )


def sparse_kind(name: str) -> SparseKind:
    if name not in _SPARSE:
        raise ValueError(f"unknown sparse kind {name!r}; registered: {sorted(_SPARSE)}")
    return _SPARSE[name]


# the built-in kinds: priced in solver.cost (with their reach, which halo children need), their patterns here
register_sparse_attention("sliding_window", mask=lambda qp, kp, p: (qp - kp) < p["window"], flash_window=lambda p: (p["window"] - 1, 0))
register_sparse_attention("chunked", mask=lambda qp, kp, p: (qp // p["chunk"]) == (kp // p["chunk"]), split_chunks=lambda p: p["chunk"])


# ----- torch reference -------------------------------------------------------------------------
SCORE_BUDGET = 1 << 24  # score-matrix elements per query block on the torch path (64 MiB in fp32)


def query_block(heads: int, keys: int, budget: int = SCORE_BUDGET) -> int:
    """Queries per block so one block's scores [heads, block, keys] stay within `budget` elements."""
    return max(1, budget // max(1, heads * keys))


def torch_varlen_attention(
    q,
    k,
    v,
    cu_seqlens,
    max_seqlen=None,
    mask: MaskFn | None = None,
    params: dict | None = None,
    budget: int = SCORE_BUDGET,
    cu_seqlens_k=None,
    q_start=None,
    k_start=None,
    sinks=None,
):
    """Causal varlen attention, optionally restricted by a sparse mask; GQA without copying K/V.
    Values may have another head size than queries and keys (MLA's): the output takes theirs.
    sinks [H]: an attention sink per query head (gpt-oss's), a logit every query's softmax
    normalizes over beside its keys' and that adds nothing to the output.

    Segment i's queries are rows cu_seqlens[i]:cu_seqlens[i+1] of q at positions q_start[i]
    onward; its keys rows cu_seqlens_k[i]:cu_seqlens_k[i+1] of k and v at positions k_start[i]
    onward, ending where its queries end (a halo child's keys reach back before its queries:
    causality is aligned bottom-right). By default the keys are the queries' rows, from position 0.
    The mask sees positions in the sample.

    Memory-bounded: queries run in blocks, each against the keys up to its last query, so a long
    sample never builds an L x L matrix (at most `budget` score elements at a time).

    >>> q = torch.randn(5, 4, 8); kv = torch.randn(5, 2, 8)
    >>> torch_varlen_attention(q, kv, kv, torch.tensor([0, 3, 5])).shape
    torch.Size([5, 4, 8])
    """
    h, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    if h % hkv:
        raise ValueError(f"query heads {h} are not a multiple of key/value heads {hkv}")
    g = h // hkv  # query heads per KV head: query head i attends to KV head i // g
    if sinks is not None and tuple(sinks.shape) != (h,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)}: one logit per query head, ({h},)")
    dv = v.shape[2]
    out = q.new_empty(q.shape[0], h, dv)
    scale = 1.0 / math.sqrt(d)
    cu = cu_seqlens.tolist()
    cu_k = cu if cu_seqlens_k is None else cu_seqlens_k.tolist()
    n = len(cu) - 1
    qs0 = [0] * n if q_start is None else [int(x) for x in q_start]
    ks0 = [0] * n if k_start is None else [int(x) for x in k_start]
    for i, (a, b, ka, kb) in enumerate(zip(cu[:-1], cu[1:], cu_k[:-1], cu_k[1:])):
        pq, pk = qs0[i], ks0[i]
        if pk + (kb - ka) != pq + (b - a):
            raise ValueError(f"segment {i}: its keys end at position {pk + kb - ka}, its queries at {pq + b - a}: they must end together")
        step = query_block(h, kb - ka, budget)
        for s0 in range(0, b - a, step):
            s1 = min(b - a, s0 + step)  # queries s0..s1 see keys up to their last position (causal)
            used = pq + s1 - pk
            qs = q[a + s0 : a + s1].reshape(s1 - s0, hkv, g, d)
            ks, vs = k[ka : ka + used], v[ka : ka + used]
            qp = torch.arange(pq + s0, pq + s1, device=q.device)[:, None]
            kp = torch.arange(pk, pk + used, device=q.device)[None, :]
            allowed = qp >= kp
            if mask is not None:
                allowed = allowed & mask(qp, kp, params or {})
            sc = torch.einsum("qhgd,khd->hgqk", qs, ks) * scale
            sc = sc.masked_fill(~allowed, float("-inf"))
            if sinks is None:
                p = torch.softmax(sc, dim=-1)
            else:  # the sink's logit joins each row's normalizer, then leaves: its weight goes nowhere
                sink = sinks.to(sc.dtype).reshape(hkv, g, 1, 1).expand(hkv, g, s1 - s0, 1)
                p = torch.softmax(torch.cat([sc, sink], dim=-1), dim=-1)[..., :-1]
            o = torch.einsum("hgqk,khd->qhgd", p, vs)
            out[a + s0 : a + s1] = o.reshape(s1 - s0, h, dv)
    return out


# ----- CUDA kernels: flash-attn, else torch's own varlen attention ---------------------------------
def _flash_fn():
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: PLC0415  (optional GPU extra)
    except ImportError as e:
        raise RuntimeError("the flash backend needs flash-attn (pip install -r requirements-gpu.txt on a CUDA machine)") from e
    return flash_attn_varlen_func


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415  (torch >= 2.10, CUDA kernels)
    except ImportError as e:
        raise RuntimeError(f"the varlen backend needs torch.nn.attention.varlen (torch {torch.__version__} has none)") from e
    return varlen_attn


def _available(load) -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        load()
    except RuntimeError:
        return False
    return True


def flash_available() -> bool:
    return _available(_flash_fn)


def varlen_available() -> bool:
    return _available(_varlen_fn)


@dataclass(frozen=True)
class KeySegments:
    """A halo child's keys, which reach back before its queries: segment i's keys are rows
    cu[i]:cu[i+1] of k and v, at positions k_start[i] onward, ending where its queries end (whose
    first position is q_start[i]); max_len the longest. Causality is aligned bottom-right, as
    flash-attn aligns it when keys outnumber queries."""

    cu: torch.Tensor  # int32 [n + 1], on the device
    max_len: int
    q_start: np.ndarray  # [n], host
    k_start: np.ndarray  # [n], host


def flash_varlen_attention(q, k, v, cu_seqlens, max_seqlen, window: tuple[int, int] = (-1, -1), fn=None, keys: KeySegments | None = None):
    """flash_attn_varlen_func with causal=True and `window_size` ((-1, -1): full causal); keys:
    key segments of their own (causal then aligned bottom-right)."""
    fn = fn or _flash_fn()
    cu = cu_seqlens.to(torch.int32)
    cu_k, max_k = (cu, int(max_seqlen)) if keys is None else (keys.cu.to(torch.int32), keys.max_len)
    return fn(q, k, v, cu, cu_k, int(max_seqlen), max_k, causal=True, window_size=window)


@functools.cache
def _varlen_keywords(fn) -> frozenset[str]:
    """The keyword arguments `fn` takes (torch's varlen_attn grew window_size in 2.11 and
    enable_gqa later); every keyword for a function whose signature cannot be read. Read once per
    function: every attention call asks."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset({"window_size", "enable_gqa"})
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return frozenset({"window_size", "enable_gqa"})
    return frozenset(p.name for p in params)


def torch_cuda_varlen_attention(
    q, k, v, cu_seqlens, max_seqlen, window: tuple[int, int] = (-1, -1), fn=None, keys: KeySegments | None = None
):
    """torch.nn.attention.varlen.varlen_attn, causal. Its window_size is flash-attn's (left, right)
    without a causal flag: full causal is (-1, 0), the last W tokens (W - 1, 0). GQA by enable_gqa
    where the installed torch has it; before that (torch 2.11), each key/value head repeated for
    the query heads that read it (query head h reads kv head h // (Hq / Hkv), enable_gqa's rule).
    A torch whose varlen_attn has no window_size (2.10) runs full causal attention only."""
    fn = fn or _varlen_fn()
    cu = cu_seqlens.to(torch.int32)
    n = int(max_seqlen)
    cu_k, max_k = (cu, n) if keys is None else (keys.cu.to(torch.int32), keys.max_len)
    takes = _varlen_keywords(fn)
    gqa = k.shape[1] != q.shape[1]
    kwargs = {}
    if "enable_gqa" in takes:
        kwargs["enable_gqa"] = gqa
    elif gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if "window_size" in takes:
        kwargs["window_size"] = (window[0], 0)
    elif window[0] >= 0:
        raise RuntimeError(
            f"torch {torch.__version__}'s varlen_attn has no window_size, so it cannot run a window of {window[0] + 1} tokens: "
            "use --attn-backend torch or flash, or torch >= 2.11"
        )
    else:
        kwargs["is_causal"] = True
    return fn(q, k, v, cu, cu_k, n, max_k, **kwargs)


WINDOWED = {"flash": flash_varlen_attention, "varlen": torch_cuda_varlen_attention}  # causal + optional window


def chunk_cu(cu_seqlens: np.ndarray, chunk: int) -> np.ndarray:
    """Refine cu_seqlens so every sample is cut into aligned chunks of `chunk` tokens.

    >>> chunk_cu(np.array([0, 5, 12]), 4).tolist()
    [0, 4, 5, 9, 12]
    """
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    bounds = [np.arange(a, b, chunk) for a, b in zip(cu[:-1], cu[1:])]
    return np.concatenate([*bounds, cu[-1:]]).astype(np.int32)


def chunk_segments(cu_q: np.ndarray, cu_k: np.ndarray, q_start: np.ndarray, k_start: np.ndarray, chunk: int):
    """Refine segments whose keys reach back before their queries into pieces inside aligned
    chunks of `chunk` positions (full causal attention on each is the chunked kind's): (cu_q, cu_k,
    q_start, k_start) of the pieces. A segment's keys start at a chunk's start (the kind's reach).

    >>> [x.tolist() for x in chunk_segments(np.array([0, 6]), np.array([0, 9]), np.array([3]), np.array([0]), 4)]
    [[0, 1, 5, 6], [0, 4, 8, 9], [3, 4, 8], [0, 4, 8]]
    """
    out_q, out_k, qs, ks = [0], [0], [], []
    for i in range(len(cu_q) - 1):
        pq, pk = int(q_start[i]), int(k_start[i])
        end = pq + int(cu_q[i + 1] - cu_q[i])
        if pk % chunk and pk < pq:
            raise ValueError(f"segment {i}: keys from position {pk} do not start a chunk of {chunk}")
        for c in range(pk - pk % chunk, end, chunk):
            q_lo, k_lo, hi = max(pq, c), max(pk, c), min(end, c + chunk)
            if hi <= q_lo:
                continue
            out_q.append(out_q[-1] + hi - q_lo)
            out_k.append(out_k[-1] + hi - k_lo)
            qs.append(q_lo)
            ks.append(k_lo)
    as_int = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return as_int(out_q), as_int(out_k), as_int(qs), as_int(ks)


def chunked_key_inputs(cu_q: np.ndarray, keys: KeySegments, chunk: int, device) -> tuple[np.ndarray, int, KeySegments]:
    """(cu_seqlens, max_seqlen, key segments) full causal attention runs on for a chunked kind
    whose keys reach back before their queries (a halo child's): chunk_segments' pieces."""
    cq, ck, qs, ks = chunk_segments(cu_q, keys.cu.cpu().numpy(), keys.q_start, keys.k_start, chunk)
    pieces = KeySegments(torch.as_tensor(ck, dtype=torch.int32, device=device), int(np.diff(ck).max(initial=0)), qs, ks)
    return cq, int(np.diff(cq).max(initial=0)), pieces


def kernel_inputs(cu_seqlens: np.ndarray, max_seqlen: int, kind: str, params: dict | None) -> tuple[np.ndarray, int, str]:
    """(cu_seqlens, max_seqlen, attention kind) a kernel runs attention of `kind` on: a chunked kind
    is full causal attention on each sample's aligned chunks. Host-side, so a placement computes it
    once per step."""
    if kind != "full":
        sk = sparse_kind(kind)
        if sk.split_chunks is not None and sk.fn is None:
            c = sk.split_chunks(params or {})
            return chunk_cu(cu_seqlens, c), min(c, int(max_seqlen)), "full"
    return np.asarray(cu_seqlens), int(max_seqlen), kind


HALF_DTYPES = (torch.float16, torch.bfloat16)  # what flash-attn's and torch's varlen kernels run


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """auto: flash-attn on CUDA when installed, else torch's varlen kernel on CUDA, for fp16 and
    bf16 (the dtypes both kernels run); else `kernel`. A CUDA kernel named for another dtype is an
    error naming it."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
    half = dtype in HALF_DTYPES
    if backend == "auto":
        if device.type == "cuda" and half:
            if flash_available():
                return "flash"
            if varlen_available():
                return "varlen"
        return "kernel"
    if backend in WINDOWED and not half:
        raise ValueError(
            f"attention backend {backend!r} runs fp16 and bf16, not {dtype}: use --dtype bf16, or --attn-backend torch or auto "
            "(auto takes the torch path for fp32)"
        )
    return backend


def varlen_attention(
    q, k, v, cu_seqlens, max_seqlen, kind: str = "full", params: dict | None = None, backend: str = "auto", fn=None,
    keys: KeySegments | None = None, sinks=None,
):  # fmt: skip
    """Full (causal) or sparse attention of `kind` over packed samples. [T, H, D] -> [T, H, D].

    fn: the underlying function of a CUDA backend (`flash` or `varlen`), given in its place (tests
    check the wrappers' arguments this way, without CUDA). keys: the key segments of a halo
    child, which reach back before the queries (k and v hold their rows; default: the queries').
    sinks [H]: an attention sink per query head (torch_varlen_attention): the torch path runs
    them, `auto` takes it; flash-attn's and torch's CUDA kernels and a kind's own kernel take no
    sinks, and naming one with sinks is an error that says so. Value heads of another size than
    the query's (MLA's, v [T, Hkv, Dv] -> [T, H, Dv]) likewise run on the torch path only.

    >>> q = torch.randn(9, 4, 8)
    >>> varlen_attention(q, q, q, torch.tensor([0, 4, 9]), 5, "sliding_window", {"window": 2}, "torch").shape
    torch.Size([9, 4, 8])
    """
    if q.shape[0] == 0:  # a rank with no tokens here: an empty output still in the graph, so every
        # rank's parameters (the sinks too) get a gradient (zeros) and all ranks reduce the same ones
        zero = (q.sum() + k.sum() + v.sum() + (0 if sinks is None else sinks.sum())) * 0
        return q.new_zeros(0, q.shape[1], v.shape[2]) + zero
    if sinks is not None:
        if backend in WINDOWED:
            raise ValueError(
                f"attention backend {backend!r} takes no attention sinks (its varlen kernel has no sink logit): use --attn-backend "
                f"torch or auto, which run them on the torch path"
            )
        backend = "torch"  # the only path with a sink logit (auto, kernel: a kind's own kernel has none)
    if v.shape[2] != q.shape[2]:  # value heads of their own size (MLA's)
        if backend in WINDOWED:
            raise ValueError(
                f"attention backend {backend!r} takes value heads of the query's size only (here {v.shape[2]} and "
                f"{q.shape[2]}): use --attn-backend torch or auto, which run them on the torch path"
            )
        backend = "torch"
    if fn is None:
        backend = resolve_backend(backend, q.device, q.dtype)
    elif backend not in WINDOWED:
        raise ValueError(f"fn replaces a CUDA backend's function: backend must be one of {sorted(WINDOWED)}, not {backend!r}")
    params = params or {}
    sk = None if kind == "full" else sparse_kind(kind)
    if sk is not None and sk.fn is not None and backend != "torch":
        if keys is not None:
            raise ValueError(f"sparse kind {kind!r}'s own kernel takes no key segments of their own (halo children): use the torch backend")
        return sk.fn(q, k, v, cu_seqlens, max_seqlen, params)
    if sk is not None and sk.split_chunks is not None:
        if keys is None:
            cu, mx, kind = kernel_inputs(cu_seqlens.cpu().numpy(), max_seqlen, kind, params)
            return varlen_attention(q, k, v, torch.as_tensor(cu, device=q.device), mx, kind, None, backend, fn, sinks=sinks)
        cq, mx, pieces = chunked_key_inputs(cu_seqlens.cpu().numpy(), keys, sk.split_chunks(params), q.device)
        cu = torch.as_tensor(cq, dtype=torch.int32, device=q.device)
        return varlen_attention(q, k, v, cu, mx, "full", None, backend, fn, pieces, sinks=sinks)
    if backend in WINDOWED and (sk is None or sk.flash_window is not None):
        window = (-1, -1) if sk is None else sk.flash_window(params)
        return WINDOWED[backend](q, k, v, cu_seqlens, max_seqlen, window, fn=fn, keys=keys)
    mask = None if sk is None else sk.mask
    if keys is None:
        return torch_varlen_attention(q, k, v, cu_seqlens, mask=mask, params=params, sinks=sinks)
    return torch_varlen_attention(
        q, k, v, cu_seqlens, mask=mask, params=params, cu_seqlens_k=keys.cu, q_start=keys.q_start, k_start=keys.k_start, sinks=sinks
    )
