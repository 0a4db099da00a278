"""Linear attention by the gated delta rule (the cheap layers of Gated DeltaNet hybrids): the
recurrence, its blockwise form with an initial state, the affine map a span applies to the state
(what sequence parallelism by state passing needs), and the short causal convolution with the
halo a rank receives from the rank before.

One head's state S is a [K, V] matrix carried along the sequence. At token t, with decay
alpha_t = exp(g_t) (g_t <= 0), strength beta_t in (0, 1), key k_t, value v_t and query q_t:

    w_t = beta_t * (v_t - (alpha_t S_{t-1})^T k_t)      the delta: what the decayed state misses
    S_t = alpha_t S_{t-1} + k_t w_t^T
    o_t = scale * S_t^T q_t

so S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T: the state a span of tokens
ends with is an affine function of the state it starts with, S_out = A S_in + B, with A [K, K]
the product of the span's transitions and B the state the span ends with from zero. Ranks that
hold consecutive chunks of a sample therefore obtain their incoming states from every rank's
(A, B) (`incoming_states`: the chain, or the log-depth scan an all-gather allows), moving
heads x K x (K + V) numbers per rank instead of the hidden states an all-to-all moves.

The blockwise form (`blockwise`; flash-linear-attention calls its blocks chunks, a word that here
means a rank's part of a sample, docs/design.md) is exact, not an approximation: within a block
of C tokens with cumulative log decay c_i = g_1 + ... + g_i and incoming state S, the deltas W
[C, V] solve the unit lower-triangular system

    (I + L) W = beta * V - (beta * exp(c)) * (K S),   L_ij = beta_i exp(c_i - c_j) k_i.k_j  (j < i)

and the outputs and the outgoing state follow in matrix products:

    O = scale * (exp(c) * (Q S) + ((Q K^T) * D) W),   D_ij = exp(c_i - c_j) (j <= i), else 0
    S_C = exp(c_C) S + K^T (exp(c_C - c) * W)

`recurrent` is the token-by-token reference the tests hold `blockwise` to. Shapes: one sequence
as q, k [T, H, K], v [T, H, V], g, beta [T, H], states [H, K, V]; `varlen` runs a packed batch
(cu_seqlens, as the attention layers take it), each sample from its own initial state. Every
function is differentiable, the initial state included, and runs in any float dtype (the tests
run float64).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable

import torch

from config import SettingError
from solver.cost import (
    STATE_DTYPES,
    gated_delta_flops,  # noqa: F401  (the layer's FLOPs: the cost model's, which the solvers read without torch)
    resolve_state_dtype,
)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    channels: bool = False,
) -> None:
    """Shapes of one sequence; ValueError naming the tensor that does not fit. channels: g decays
    each key channel ([T, H, K], model.kda), not each head ([T, H])."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must be [T, H, K] alike; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    t, h, dk = q.shape
    if v.dim() != 3 or v.shape[:2] != (t, h):
        raise ValueError(f"v must be [T={t}, H={h}, V]; got {tuple(v.shape)}")
    if g.shape != ((t, h, dk) if channels else (t, h)):
        raise ValueError(f"g must be [T={t}, H={h}{f', K={dk}' if channels else ''}]; got {tuple(g.shape)}")
    if beta.shape != (t, h):
        raise ValueError(f"beta must be [T={t}, H={h}]; got {tuple(beta.shape)}")
    if state is not None and state.shape != (h, dk, v.shape[2]):
        raise ValueError(f"the initial state must be [H={h}, K={dk}, V={v.shape[2]}]; got {tuple(state.shape)}")


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def recurrent(q, k, v, g, beta, initial_state=None, scale: float | None = None):
    """Token by token (the reference): (o [T, H, V], final state [H, K, V])."""
    _check(q, k, v, g, beta, initial_state)
    t, h, dk = q.shape
    s = q.new_zeros(h, dk, v.shape[2]) if initial_state is None else initial_state
    scale = _scale(q, scale)
    out = []
    for i in range(t):
        s = s * g[i].exp()[:, None, None]  # alpha_t S_{t-1}
        w = beta[i][:, None] * (v[i] - torch.einsum("hkv,hk->hv", s, k[i]))
        s = s + k[i][:, :, None] * w[:, None, :]
        out.append(scale * torch.einsum("hkv,hk->hv", s, q[i]))
    return (torch.stack(out) if out else v.new_zeros(0, h, v.shape[2])), s


def _block(q, k, v, g, beta, s, scale: float):
    """One block, heads first: q, k [H, C, K], v [H, C, V], g, beta [H, C], s [H, K, V] -> (o [H, C, V], s_out)."""
    c = g.cumsum(-1)  # [H, C]
    n = q.shape[1]
    upto = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    # D_ij = exp(c_i - c_j) for j <= i, else 0 (exp(-inf) = 0, and no exp of the unused upper part)
    decay = torch.where(upto, c[:, :, None] - c[:, None, :], torch.tensor(float("-inf"), dtype=c.dtype, device=c.device)).exp()
    below = beta[:, :, None] * (k @ k.transpose(-1, -2)) * decay.tril(-1)  # L
    system = below + torch.eye(n, dtype=q.dtype, device=q.device)
    rhs = beta[:, :, None] * v - (beta * c.exp())[:, :, None] * (k @ s)
    w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    o = scale * (c.exp()[:, :, None] * (q @ s) + ((q @ k.transpose(-1, -2)) * decay) @ w)
    last = c[:, -1:]  # [H, 1]
    s_out = last.exp()[:, :, None] * s + k.transpose(-1, -2) @ ((last - c).exp()[:, :, None] * w)
    return o, s_out


def blockwise(q, k, v, g, beta, initial_state=None, scale: float | None = None, block: int = 64, step=_block):
    """Blocks of `block` tokens (the last may be shorter): (o [T, H, V], final state [H, K, V]).
    step: one block's form (`_block`; a variant of the rule: its own, model.kda)."""
    _check(q, k, v, g, beta, initial_state, channels=step is not _block)
    if block < 1:
        raise ValueError(f"block={block}: a block holds at least one token")
    t, h, dk = q.shape
    s = q.new_zeros(h, dk, v.shape[2]) if initial_state is None else initial_state
    scale = _scale(q, scale)
    heads_first = [x.transpose(0, 1) for x in (q, k, v, g, beta)]
    out = []
    for a in range(0, t, block):
        o, s = step(*(x[:, a : a + block] for x in heads_first), s, scale)
        out.append(o)
    o = torch.cat(out, dim=1).transpose(0, 1) if out else v.new_zeros(0, h, v.shape[2])
    return o, s


def transition(k, g, beta, block: int = 64, step=_block) -> torch.Tensor:
    """A [H, K, K]: the linear part of the map a span applies to its incoming state (S_out = A S_in
    + B). It is the state the span ends with from S_in = I when every value is zero (then B = 0),
    so it comes from the same blockwise recurrence, with K columns for V: the extra work state
    passing pays, about K / V times a pass of the span's state updates."""
    t, h, dk = k.shape
    eye = torch.eye(dk, dtype=k.dtype, device=k.device).expand(h, dk, dk)
    return blockwise(k, k, k.new_zeros(t, h, dk), g, beta, initial_state=eye, block=block, step=step)[1]


def compose(first: tuple[torch.Tensor, torch.Tensor], then: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The affine map of two spans in a row: S -> A2 (A1 S + B1) + B2."""
    (a1, b1), (a2, b2) = first, then
    return a2 @ a1, a2 @ b1 + b2


def incoming_states(maps: list[tuple[torch.Tensor, torch.Tensor]], initial=None, how: str = "chain") -> list[torch.Tensor]:
    """The state each span starts with, for spans in sequence order with maps (A_r, B_r): span 0
    starts from `initial` (zeros if None), span r from the end of span r - 1.

    how="chain": S_{r+1} = A_r S_r + B_r, one span after another (what point-to-point hops do);
    how="scan": the prefix maps by doubling (Hillis-Steele: log2(R) rounds of compose), what
    each rank can do once an all-gather has given it every (A_r, B_r). Both are exact; they
    differ in rounding only."""
    if how not in ("chain", "scan"):
        raise ValueError(f"how={how!r}: use 'chain' or 'scan'")
    if not maps:
        return []
    h, dk, dv = maps[0][1].shape
    s0 = maps[0][1].new_zeros(h, dk, dv) if initial is None else initial
    if how == "chain":
        states = [s0]
        for a, b in maps[:-1]:
            states.append(a @ states[-1] + b)
        return states
    prefix = list(maps)  # prefix[r]: the map of spans 0..r (after the rounds)
    step = 1
    while step < len(prefix):
        prefix = [p if r < step else compose(prefix[r - step], p) for r, p in enumerate(prefix)]
        step *= 2
    return [s0] + [a @ s0 + b for a, b in prefix[:-1]]


def varlen(q, k, v, g, beta, cu_seqlens, initial_states=None, scale: float | None = None, block: int = 64, step=_block):
    """A packed batch: sample i is rows cu_seqlens[i]:cu_seqlens[i+1], run from initial_states[i]
    ([N, H, K, V]; zeros if None). Returns (o [T, H, V], final states [N, H, K, V])."""
    bounds = [int(x) for x in cu_seqlens]
    if not bounds or bounds[0] != 0 or bounds[-1] != q.shape[0] or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={q.shape[0]}; got {bounds[:8]}{'...' if len(bounds) > 8 else ''}")
    if len(bounds) == 1:  # no sample (a rank that holds no token)
        return v.new_zeros(0, *v.shape[1:]), v.new_zeros(0, q.shape[1], q.shape[2], v.shape[2])
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        s = None if initial_states is None else initial_states[i]
        o, s = blockwise(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s, scale, block, step)
        outs.append(o)
        finals.append(s)
    return torch.cat(outs), torch.stack(finals)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim: the gated delta rule's query and key norm, as
    flash-linear-attention's kernels and transformers' Qwen3-Next compute it."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, halo: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution of one sequence chunk x [T, C] with weight [C, W]: y_t = sum_j
    weight[:, j] * x_{t - W + 1 + j}. Positions before the chunk come from `halo` [W - 1, C] (the
    last W - 1 rows of the chunk before it, on the rank before), or are zero at a sample's start."""
    t, ch = x.shape
    if weight.dim() != 2 or weight.shape[0] != ch:
        raise ValueError(f"weight must be [C={ch}, W]; got {tuple(weight.shape)}")
    reach = weight.shape[1] - 1
    if halo is None:
        halo = x.new_zeros(reach, ch)
    if halo.shape != (reach, ch):
        raise ValueError(f"the halo must be [W - 1 = {reach}, C={ch}]: the rows before the chunk; got {tuple(halo.shape)}")
    padded = torch.cat([halo, x])  # [T + W - 1, C]
    return sum(weight[:, j] * padded[j : j + t] for j in range(reach + 1))


# ----- state passing between ranks ----------------------------------------------------------
class _Chain(torch.autograd.Function):
    """Point-to-point hops along the ranks of `group` in rank order: rank r receives its incoming
    state S_r from rank r - 1 and sends S_{r+1} = A_r S_r + B_r to rank r + 1. The backward runs
    the chain in reverse: rank r receives the gradient of S_{r+1} from rank r + 1, adds A_r^T of
    it to its own, and sends the sum to rank r - 1 (rank 0's sum is the initial state's gradient)."""

    @staticmethod
    def forward(ctx, a, b, initial, group):
        import torch.distributed as dist  # noqa: PLC0415

        rank, size = dist.get_rank(group), dist.get_world_size(group)
        peers = dist.get_process_group_ranks(group) if group is not None else list(range(size))
        s = initial.detach().clone()
        if rank > 0:
            dist.recv(s, src=peers[rank - 1], group=group)
        if rank < size - 1:
            dist.send((a @ s + b).contiguous(), dst=peers[rank + 1], group=group)
        ctx.save_for_backward(a, s)
        ctx.group, ctx.rank, ctx.size, ctx.peers = group, rank, size, peers
        return s

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist  # noqa: PLC0415

        a, s = ctx.saved_tensors
        total = grad.clone()
        grad_a = grad_b = None
        if ctx.rank < ctx.size - 1:
            after = torch.empty_like(grad)  # the gradient of S_{r+1}, from rank r + 1
            dist.recv(after, src=ctx.peers[ctx.rank + 1], group=ctx.group)
            total = total + a.transpose(-1, -2) @ after
            grad_a, grad_b = after @ s.transpose(-1, -2), after
        else:
            grad_a, grad_b = torch.zeros_like(a), torch.zeros_like(grad)
        if ctx.rank > 0:
            dist.send(total.contiguous(), dst=ctx.peers[ctx.rank - 1], group=ctx.group)
            return grad_a, grad_b, torch.zeros_like(total), None
        return grad_a, grad_b, total, None


def pass_states(a: torch.Tensor, b: torch.Tensor, initial: torch.Tensor | None = None, group=None, how: str = "scan") -> torch.Tensor:
    """This rank's incoming state for a sample cut into contiguous chunks over the ranks of
    `group`, in rank order; (a, b): this rank's chunk's map (`transition`, and the state its chunk
    ends with from zero). `initial`: the sample's state before the first chunk (rank 0's; zeros
    if None). Differentiable in a, b and initial on every rank.

    how="scan": one all-gather of every rank's (A, B) and rank 0's initial state, then the prefix
    on each rank (incoming_states: log-depth compose, every rank holds every map);
    how="chain": point-to-point hops, one rank after another (R - 1 sequential messages of one
    state each, forward and backward).

    The backward is a collective of the group as well: every rank of it must backpropagate
    through its incoming state (its chunk's outputs reach the loss), so a sample's group is the
    ranks that hold a non-empty chunk of it."""
    import torch.distributed as dist  # noqa: PLC0415

    if initial is None:
        initial = b.new_zeros(b.shape)
    if how == "chain":
        return _Chain.apply(a, b, initial, group)
    if how != "scan":
        raise ValueError(f"how={how!r}: use 'scan' or 'chain'")
    from torch.distributed.nn.functional import all_gather  # noqa: PLC0415  (differentiable)

    rank = dist.get_rank(group)
    packed = torch.cat([a.reshape(-1), b.reshape(-1), initial.reshape(-1)])
    if torch.is_grad_enabled() and not packed.requires_grad:
        packed = packed.detach().requires_grad_()  # every rank's backward joins the collective
    gathered = all_gather(packed, group=group or dist.group.WORLD)
    na, nb = a.numel(), b.numel()
    maps = [(x[:na].view(a.shape), x[na : na + nb].view(b.shape)) for x in gathered]
    start = gathered[0][na + nb :].view(b.shape)  # rank 0's initial state reaches every rank
    return incoming_states(maps, start, "scan")[rank]


# ----- the layer ------------------------------------------------------------------------------
FLA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what fla's chunked kernel runs (not float64)


@functools.cache
def fla_refusal() -> str | None:
    """Why flash-linear-attention's chunked kernel cannot train this layer on this machine, or None.
    fla-core refuses its gated backward on Hopper under Triton >= 3.4 and < 3.7.1 (a Triton
    regression gave wrong gradients there) unless tilelang is installed to take that kernel; a
    layer told to use fla would then fail at its first backward, so it runs this module's form.
    Answered once per process (every layer's forward asks; the tilelang lookup searches the path)."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1  # noqa: PLC0415
    except ImportError:
        return None
    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1 and importlib.util.find_spec("tilelang") is None:
        import triton  # noqa: PLC0415

        return (
            f"fla-core refuses its gated backward on Hopper under Triton {triton.__version__} (>= 3.4, < 3.7.1) without tilelang; "
            "upgrade Triton to >= 3.7.1 or pip install tilelang to use its kernel"
        )
    return None


def _fla_chunk():
    """flash-linear-attention's chunked gated delta rule (CUDA), or None where it is not installed
    or cannot train here (fla_refusal: warned once, and this module's blockwise form runs)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: PLC0415
    except ImportError:
        return None
    why = fla_refusal()
    if why is not None:
        warnings.warn(f"the Gated DeltaNet layers run this project's blockwise form: {why}", RuntimeWarning, stacklevel=2)
        return None
    return chunk_gated_delta_rule


class GatedDeltaNet(torch.nn.Module):
    """A Gated DeltaNet layer on a packed batch, as the public GDN hybrids build it: projections of
    q, k (n_k_heads x head_k_dim), v and an output gate z (n_v_heads x head_v_dim), a decay input a
    and a strength input b (one per value head); a short depthwise causal convolution over the q,
    k, v channels, then SiLU; q and k L2-normalized per head, each value head reading key head
    j // (n_v_heads / n_k_heads) (grouped values); g = -exp(A_log) softplus(a + dt_bias), beta =
    sigmoid(b); the gated delta rule from each sample's incoming state; the output normalized per
    head (RMS), times SiLU(z), projected back to the hidden size.

    forward(x [n, hidden], cu_seqlens, states=None [N, Hv, Dk, Dv], halos=None [N, W - 1, C]) ->
    (out [n, hidden], final states, tails [N, W - 1, C]): a sample's chunk continues from its
    incoming state and from the convolution's halo (its previous chunk's last W - 1 pre-conv
    rows; zeros at a sample's start), and hands on its final state and its own tail, so chunks of
    a sample on consecutive ranks give what the whole sample gives. CUDA with fla-core installed:
    flash-linear-attention's chunked kernel; elsewhere this module's `blockwise`.

    A variant of the rule (another linear kind: model.kda) subclasses it and overrides what
    differs: its recurrence over a packed batch and its transition (`varlen`, `transition`: g of
    another shape), fla's kernel for it (`fla_chunk`), the width of its decay input per value head
    (`decay_width`), its projections and gates (`_project`, `_gates`) and its output (`_output`)."""

    varlen = staticmethod(varlen)  # the rule over a packed batch, each sample from its own state
    transition = staticmethod(transition)  # the map A of a chunk (S_out = A S_in + B)
    decay_width = 1  # decay inputs per value head: one scalar decay (the gated delta rule)

    @staticmethod
    def fla_chunk():
        """flash-linear-attention's chunked kernel of this rule (CUDA), or None."""
        return _fla_chunk()

    def __init__(
        self,
        hidden: int,
        n_k_heads: int,
        n_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int = 4,
        norm_eps: float = 1e-6,
        block: int = 64,
        state_dtype: str = "auto",
    ):
        super().__init__()
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype={state_dtype!r} is not one of {list(STATE_DTYPES)}")
        if n_k_heads < 1 or n_v_heads % n_k_heads:
            raise ValueError(f"n_v_heads={n_v_heads} must be a multiple of n_k_heads={n_k_heads} (each value head reads one key head)")
        if conv_kernel < 1:
            raise ValueError(f"conv_kernel={conv_kernel}: the convolution reads at least the token itself")
        if conv_kernel - 1 > block:
            raise ValueError(f"conv_kernel={conv_kernel} reaches past a block of {block} tokens; use a kernel of at most {block + 1}")
        self.hk, self.hv, self.dk, self.dv = n_k_heads, n_v_heads, head_k_dim, head_v_dim
        self.kernel, self.eps, self.block, self.state = conv_kernel, norm_eps, block, state_dtype
        self.channels = 2 * n_k_heads * head_k_dim + n_v_heads * head_v_dim  # what the convolution reads
        self.w_in = torch.nn.Linear(hidden, self.channels + n_v_heads * head_v_dim + 2 * n_v_heads, bias=False)
        self.conv = torch.nn.Parameter(torch.randn(self.channels, conv_kernel) / conv_kernel**0.5)
        self.A_log = torch.nn.Parameter(torch.empty(n_v_heads).uniform_(1, 16).log())
        self.dt_bias = torch.nn.Parameter(torch.ones(n_v_heads))
        self.norm = torch.nn.Parameter(torch.ones(head_v_dim))
        self.w_out = torch.nn.Linear(n_v_heads * head_v_dim, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, cu_seqlens, states: torch.Tensor | None = None, halos: torch.Tensor | None = None, backend: str = "auto"
    ):
        mixed, z, a, b = self._project(x)
        o, finals, tails = self.mix(mixed, a, b, cu_seqlens, states, halos, backend)
        return self._output(o, z), finals, tails

    def mix(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, cu_seqlens, states=None, halos=None, backend: str = "auto"):
        """The layer between its projections, what the cost model prices at the linear rate
        (solver.cost's gated_delta flops): the convolution over `mixed` [n, C] (the convolution's
        channels), the gates from a, b [n, Hv], the gated delta rule -> (o [n, Hv, Dv], final
        states, tails), as forward."""
        bounds = [int(c) for c in cu_seqlens]
        q, k, v, g, beta, tails = self._inputs(mixed, a, b, bounds, halos)
        o, finals = self._recurrence(q, k, v, g, beta, bounds, states, backend)
        return o, finals, tails

    def state_dtype(self, compute: torch.dtype) -> torch.dtype:
        """The dtype this layer carries its states and maps in when its activations are `compute`
        (its state_dtype setting; auto: float32, or float64 where the activations are)."""
        return getattr(torch, resolve_state_dtype(self.state, compute.itemsize))

    def _recurrence(self, q, k, v, g, beta, bounds, states, backend: str = "auto"):
        """The gated delta rule over a packed batch, each value head reading its key head, its
        states in the layer's state dtype: fla's chunked kernel on CUDA where fla-core is
        installed and runs the dtype (FLA_DTYPES), unless `backend` (the attention backend
        setting) is "torch"; else `varlen` in the state dtype (autocast off: a chunked kernel
        accumulates in float32 whatever its inputs). (o in the activations' dtype, final states)."""
        act, sd = v.dtype, self.state_dtype(v.dtype)
        if len(bounds) == 1:  # no sample (an idle rank): empty outputs that still reach every input, so a
            # sharded model's gradient reduction finds every parameter's (zero) gradient on every rank
            joined = 0.0 * sum(t.sum() for t in (q, k, v, g, beta))
            return v.new_zeros(0, *v.shape[1:]) + joined, v.new_zeros(0, v.shape[1], q.shape[2], v.shape[2], dtype=sd)
        fla = self.fla_kernel(q.is_cuda, q.dtype, backend)
        if fla is not None:
            cu = torch.as_tensor(bounds, dtype=torch.long, device=q.device)
            o, finals = fla(q[None], k[None], v[None], g[None], beta[None], initial_state=states, output_final_state=True, cu_seqlens=cu)
            return o[0], finals
        with torch.autocast(q.device.type, enabled=False):
            q, k, v, g, beta = (x.to(sd) for x in (q, k, v, g, beta))
            o, finals = self.varlen(
                self._grouped(q, v.shape[1]), self._grouped(k, v.shape[1]), v, g, beta, bounds,
                None if states is None else states.to(sd), block=self.block,
            )  # fmt: skip
        return o.to(act), finals

    def fla_kernel(self, cuda: bool, dtype: torch.dtype, backend: str):
        """fla's chunked kernel where it runs this layer (CUDA, fla-core installed, a dtype of
        FLA_DTYPES, the attention backend not "torch"), else None (this module's `varlen`). A
        state dtype it lacks (it carries float32 states) is a SettingError naming the setting."""
        fla = self.fla_chunk() if cuda and backend != "torch" and dtype in FLA_DTYPES else None
        if fla is not None and self.state_dtype(dtype) != torch.float32:
            raise SettingError(
                f"state_dtype={self.state}: flash-linear-attention's chunked kernel carries float32 states; use "
                "state_dtype=float32 or auto, or --attn-backend torch (this project's blockwise form runs any dtype)"
            )
        return fla

    def chunk_map(self, q, k, v, g, beta, backend: str = "auto") -> torch.Tensor:
        """The map (A, B) one chunk applies to its incoming state (S_out = A S_in + B), in the state
        dtype, as [Hv, Dk, Dk + Dv]: A by `transition`, B the chunk's final state from zero."""
        final = self._recurrence(q, k, v, g, beta, [0, q.shape[0]], None, backend)[1][0]
        with torch.autocast(q.device.type, enabled=False):
            sd = final.dtype
            a = self.transition(self._grouped(k, v.shape[1]).to(sd), g.to(sd), beta.to(sd), self.block)
        return torch.cat([a, final], dim=-1)

    # ----- Ulysses: heads split over a group, whole samples per head ---------------------------
    def ulysses_columns(self) -> torch.Tensor:
        """The columns of cat([conv channels, a, b]) (this layer's `_project`) in the order its
        Ulysses entry sends them (solver.cost.gated_delta_ulysses, which the simulator prices):
        the values, a, b, then q and k element by element (element j of every key head)."""
        qk, c, hv = self.hk * self.dk, self.channels, self.hv
        by_element = torch.arange(qk).view(self.hk, self.dk).T.reshape(-1)
        return torch.cat([torch.arange(2 * qk, c), torch.arange(c, c + (self.decay_width + 1) * hv), by_element, qk + by_element])

    def forward_heads(self, y: torch.Tensor, cu_seqlens, size: int, index: int, backend: str = "auto") -> torch.Tensor:
        """The head side of a Ulysses group of `size` ranks, rank `index` in it: y [m, E] its
        columns of the entry (ulysses_columns split over the group: its value heads, with their
        a and b, and the key heads they read, replicated when the group is wider than the key
        heads) for whole samples (cu_seqlens) -> o [m, value heads / size, head_v_dim]. The
        convolution, the gates and the recurrence run on these heads only, from zero states."""
        if self.hv % size or (self.hk % size and size % self.hk):
            raise ValueError(f"a group of {size} ranks cannot split {self.hv} value heads and {self.hk} key heads")
        hv, split = self.hv // size, self.hk % size == 0
        hk = self.hk // size if split else 1
        k0, v0 = (index * hk if split else index // (size // self.hk)), index * hv
        m, dk, dv, qk = y.shape[0], self.dk, self.dv, self.hk * self.dk
        v, a, b, q, k = y.split([hv * dv, hv * self.decay_width, hv, dk * hk, dk * hk], dim=1)
        q, k = (t.reshape(m, dk, hk).transpose(1, 2).reshape(m, hk * dk) for t in (q, k))
        key_channels = (torch.arange(k0, k0 + hk)[:, None] * dk + torch.arange(dk)).reshape(-1)
        value_channels = 2 * qk + (torch.arange(v0, v0 + hv)[:, None] * dv + torch.arange(dv)).reshape(-1)
        heads = slice(v0, v0 + hv)
        conv = self.conv[torch.cat([key_channels, qk + key_channels, value_channels]).to(self.conv.device)]
        bounds = [int(c) for c in cu_seqlens]
        q, k, v, g, beta, _ = self._inputs(
            torch.cat([q, k, v], dim=1), a, b, bounds, None, (conv, self.A_log[heads], self.dt_bias[heads], hk, hv)
        )
        return self._recurrence(q, k, v, g, beta, bounds, None, backend)[0]

    def _project(self, x):
        """x [n, hidden] -> (the convolution's channels [n, C], the output gate, the decay and strength inputs)."""
        return self.w_in(x).split([self.channels, self.hv * self.dv, self.hv, self.hv], dim=-1)

    def _tail(self, rows: torch.Tensor, halo: torch.Tensor | None) -> torch.Tensor:
        """The last W - 1 pre-conv rows up to a chunk's end (its halo's where the chunk is shorter)."""
        reach, channels = self.kernel - 1, rows.shape[1]
        before = rows.new_zeros(reach, channels) if halo is None else halo
        return torch.cat([before, rows])[-reach:] if reach else rows.new_zeros(0, channels)

    def _inputs(self, mixed, a, b, bounds, halos, heads=None):
        """The recurrence's q, k [n, Hk, Dk], v [n, Hv, Dv], g, beta [n, Hv] from the projections:
        each sample's chunk convolved from its halo; and each chunk's tail. heads: (convolution
        weights, A_log, dt_bias, key heads, value heads) of a subset of the heads (forward_heads);
        None: all of them."""
        conv, a_log, dt_bias, hk, hv = heads if heads is not None else (self.conv, self.A_log, self.dt_bias, self.hk, self.hv)
        n = mixed.shape[0]
        conv_out, tails = [], []
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            halo = None if halos is None else halos[i]
            conv_out.append(causal_conv(mixed[lo:hi], conv, halo))
            tails.append(self._tail(mixed[lo:hi], halo))
        # no sample here (an idle rank): the convolution's weights still join the graph (_recurrence)
        mixed = torch.nn.functional.silu(torch.cat(conv_out)) if conv_out else mixed + 0.0 * conv.sum()
        q, k, v = mixed.split([hk * self.dk, hk * self.dk, hv * self.dv], dim=-1)
        q = l2norm(q.view(n, hk, self.dk))
        k = l2norm(k.view(n, hk, self.dk))
        g = self._gates(a, a_log, dt_bias)
        tails = torch.stack(tails) if tails else mixed.new_zeros(0, self.kernel - 1, mixed.shape[1])
        return q, k, v.view(n, hv, self.dv), g, torch.sigmoid(b), tails

    @staticmethod
    def _gates(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
        """The log decay g [n, Hv] from the decay inputs a [n, Hv]: -exp(A_log) softplus(a + dt_bias)."""
        return -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)

    @staticmethod
    def _grouped(x, value_heads: int):
        """Key heads [n, Hk, Dk] repeated for `value_heads` value heads: value head j reads key head j // (Hv / Hk)."""
        return x.repeat_interleave(value_heads // x.shape[1], dim=1)

    def _output(self, o, z):
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + self.eps) * self.norm
        return self.w_out(o.reshape(o.shape[0], self.hv * self.dv) * torch.nn.functional.silu(z))


# the runtime of each linear kind's S layers (model.hybrid.LinearBlock): kind name -> build(hidden,
# the kind's resolved parameters, norm_eps) -> its mixer; a kind not here runs its S layers as
# attention (model.attention's registry). A linear kind's module registers its mixer here, as it
# registers its cost with solver.kinds.
LINEAR_MIXERS: dict[str, Callable[[int, dict, float], torch.nn.Module]] = {}


def register_linear_mixer(name: str, build: Callable[[int, dict, float], torch.nn.Module]) -> None:
    """The mixer of linear kind `name`'s S layers (its cost is solver.kinds' record of the same name)."""
    LINEAR_MIXERS[name] = build


register_linear_mixer(
    "gated_delta",
    lambda hidden, p, eps: GatedDeltaNet(
        hidden, p["k_heads"], p["v_heads"], p["head_k_dim"], p["head_v_dim"], p["conv_kernel"], eps, p["block"], p["state_dtype"]
    ),
)
