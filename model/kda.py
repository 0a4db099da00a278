"""Kimi Delta Attention (the linear layers of Kimi Linear): the gated delta rule with a decay per
key channel instead of per head. One head's state S is a [K, V] matrix; at token t, with channel
decays alpha_t = exp(g_t) (g_t [K] <= 0), strength beta_t, key k_t, value v_t and query q_t:

    w_t = beta_t * (v_t - (Diag(alpha_t) S_{t-1})^T k_t)
    S_t = Diag(alpha_t) S_{t-1} + k_t w_t^T
    o_t = scale * S_t^T q_t

So S_t is still an affine function of S_{t-1} (a span's map S_out = A S_in + B, A [K, K]): state
passing, Ulysses and the halo of the short convolution run as for the gated delta rule
(model.linear), with this rule's block in place of its block.

Blockwise, within a block of C tokens with cumulative log decays c_i = g_1 + ... + g_i (one per
channel) and incoming state S, the deltas W [C, V] solve the unit lower-triangular system

    (I + L) W = beta * V - beta * ((K * exp(c)) S),  L_ij = beta_i sum_k k_ik k_jk exp(c_ik - c_jk)  (j < i)

and, with E_ijk = exp(c_ik - c_jk) for j <= i (every factor at most 1: the decays are products of
numbers at most 1, so no term overflows whatever the block's length),

    O = scale * ((Q * exp(c)) S + P W),   P_ij = sum_k q_ik k_jk E_ijk  (j <= i)
    S_C = exp(c_C) * S + (K * exp(c_C - c))^T W

`recurrent` is the token-by-token reference; flash-linear-attention's `naive_recurrent_kda` is a
second (in float32). The layer, `KimiDeltaAttention`, is model.linear's GatedDeltaNet with this
rule, a decay per key channel from a low-rank projection, and an output gate (also low-rank) taken
through a sigmoid, as Kimi Linear builds its KDA layers. On CUDA with fla-core installed it runs
fla's chunked KDA kernel (`fla.ops.kda.chunk_kda`).
"""

from __future__ import annotations

import functools
import warnings

import torch

from . import linear
from .linear import GatedDeltaNet, fla_refusal, register_linear_mixer


def recurrent(q, k, v, g, beta, initial_state=None, scale: float | None = None):
    """Token by token (the reference): q, k [T, H, K], v [T, H, V], g [T, H, K], beta [T, H] ->
    (o [T, H, V], final state [H, K, V]).

    >>> T, H, K, V = 5, 2, 4, 3
    >>> q, k, v = torch.randn(T, H, K), torch.randn(T, H, K), torch.randn(T, H, V)
    >>> o, s = recurrent(q, k, v, -torch.rand(T, H, K), torch.rand(T, H))
    >>> tuple(o.shape), tuple(s.shape)
    ((5, 2, 3), (2, 4, 3))
    """
    linear._check(q, k, v, g, beta, initial_state, channels=True)
    t, h, dk = q.shape
    s = q.new_zeros(h, dk, v.shape[2]) if initial_state is None else initial_state
    scale = linear._scale(q, scale)
    out = []
    for i in range(t):
        s = g[i].exp()[:, :, None] * s  # Diag(alpha_t) S_{t-1}
        w = beta[i][:, None] * (v[i] - torch.einsum("hk,hkv->hv", k[i], s))
        s = s + k[i][:, :, None] * w[:, None, :]
        out.append(scale * torch.einsum("hk,hkv->hv", q[i], s))
    o = torch.stack(out) if out else v.new_zeros(0, h, v.shape[2])
    return o, s


def _block(q, k, v, g, beta, s, scale: float):
    """One block, heads first: q, k [H, C, K], v [H, C, V], g [H, C, K], beta [H, C], s [H, K, V]
    -> (o [H, C, V], s_out), as the module's docstring derives it."""
    c = g.cumsum(1)  # [H, C, K]
    n = q.shape[1]
    upto = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    diff = c[:, :, None, :] - c[:, None, :, :]  # [H, C, C, K]: c_i - c_j
    # E_ijk = exp(c_ik - c_jk) for j <= i, else 0 (exp(-inf) = 0: no exp of the unused upper part)
    decay = torch.where(upto[None, :, :, None], diff, torch.tensor(float("-inf"), dtype=c.dtype, device=c.device)).exp()
    below = beta[:, :, None] * torch.einsum("hik,hjk,hijk->hij", k, k, decay).tril(-1)  # L
    system = below + torch.eye(n, dtype=q.dtype, device=q.device)
    rhs = beta[:, :, None] * (v - (k * c.exp()) @ s)
    w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    o = scale * ((q * c.exp()) @ s + torch.einsum("hik,hjk,hijk->hij", q, k, decay) @ w)
    last = c[:, -1:, :]  # [H, 1, K]
    s_out = last.transpose(1, 2).exp() * s + (k * (last - c).exp()).transpose(1, 2) @ w
    return o, s_out


# the rule's blockwise form, packed batches and chunk maps: model.linear's, with this rule's block
blockwise = functools.partial(linear.blockwise, step=_block)
varlen = functools.partial(linear.varlen, step=_block)
transition = functools.partial(linear.transition, step=_block)


def _fla_chunk():
    """flash-linear-attention's chunked KDA kernel (CUDA), or None where it is not installed or
    cannot train here (fla_refusal: warned once, and this module's blockwise form runs)."""
    try:
        from fla.ops.kda import chunk_kda  # noqa: PLC0415
    except ImportError:
        return None
    why = fla_refusal()
    if why is not None:
        warnings.warn(f"the KDA layers run this project's blockwise form: {why}", RuntimeWarning, stacklevel=2)
        return None
    return chunk_kda


class KimiDeltaAttention(GatedDeltaNet):
    """A Kimi Delta Attention layer on a packed batch, as Kimi Linear builds it: projections of q,
    k (n_k_heads x head_k_dim) and v (n_v_heads x head_v_dim), a strength input b (one per value
    head), a decay input f = f_b(f_a(x)) (head_k_dim per value head, through a rank-`gate_rank`
    bottleneck) and an output gate z = g_b(g_a(x)) (head_v_dim per value head, likewise); the
    short causal convolution over q, k, v, then SiLU; q and k L2-normalized per head; g =
    -exp(A_log) softplus(f + dt_bias) per key channel (A_log per head, dt_bias per channel), beta =
    sigmoid(b); the rule (`varlen`) from each sample's incoming state; the output normalized per
    head (RMS), times sigmoid(z), projected back to the hidden size. Everything else (its halos,
    states and Ulysses exchanges) is GatedDeltaNet's, which the distributed step runs unchanged.

    >>> layer = KimiDeltaAttention(16, 2, 2, 4, 4, gate_rank=4)
    >>> out, finals, tails = layer(torch.randn(7, 16), [0, 3, 7])
    >>> tuple(out.shape), tuple(finals.shape), tuple(tails.shape)
    ((7, 16), (2, 2, 4, 4), (2, 3, 24))
    """

    varlen = staticmethod(varlen)
    transition = staticmethod(transition)

    @staticmethod
    def fla_chunk():
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
        gate_rank: int = 128,
    ):
        super().__init__(hidden, n_k_heads, n_v_heads, head_k_dim, head_v_dim, conv_kernel, norm_eps, block, state_dtype)
        if gate_rank < 1:
            raise ValueError(f"gate_rank={gate_rank}: the gates' bottleneck holds at least one channel")
        self.rank = gate_rank
        # the input projection: the convolution's channels, the output gate's and the decay's
        # bottlenecks, the strength input; then the two up-projections
        self.w_in = torch.nn.Linear(hidden, self.channels + 2 * gate_rank + n_v_heads, bias=False)
        self.f_b = torch.nn.Linear(gate_rank, n_v_heads * head_k_dim, bias=False)
        self.g_b = torch.nn.Linear(gate_rank, n_v_heads * head_v_dim, bias=False)
        self.dt_bias = torch.nn.Parameter(torch.ones(n_v_heads, head_k_dim))

    @property
    def decay_width(self) -> int:
        return self.dk  # a decay input per key channel of each value head

    def _project(self, x):
        """x [n, hidden] -> (the convolution's channels [n, C], the output gate z [n, Hv Dv], the
        decay inputs f [n, Hv Dk], the strength inputs b [n, Hv])."""
        mixed, gate, decay, b = self.w_in(x).split([self.channels, self.rank, self.rank, self.hv], dim=-1)
        return mixed, self.g_b(gate), self.f_b(decay), b

    @staticmethod
    def _gates(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
        """The log decays g [n, Hv, Dk] from the decay inputs a [n, Hv Dk]: -exp(A_log) softplus(a + dt_bias)."""
        heads, dk = dt_bias.shape
        return -a_log.exp()[:, None] * torch.nn.functional.softplus(a.view(-1, heads, dk) + dt_bias)

    def _output(self, o, z):
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + self.eps) * self.norm
        return self.w_out(o.reshape(o.shape[0], self.hv * self.dv) * torch.sigmoid(z))


register_linear_mixer(
    "kda",
    lambda hidden, p, eps: KimiDeltaAttention(
        hidden, p["k_heads"], p["v_heads"], p["head_k_dim"], p["head_v_dim"], p["conv_kernel"], eps, p["block"], p["state_dtype"],
        p["gate_rank"],
    ),
)  # fmt: skip
