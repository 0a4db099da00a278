"""The hybrid 1F3S MoE transformer: full (causal) and sparse attention layers by a pattern string.

The model is layout-agnostic: attention goes through a placement that knows where the tokens
are. `LocalPlacement` runs every sample on one process (the reference); model.distributed's
`RankPlacement` runs one rank's part of a StepPlan on a process group.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from config import RECOMPUTE, ModelConfig, SettingError
from solver.cost import sparse_cost

from .attention import KeySegments, chunked_key_inputs, kernel_inputs, sparse_kind, varlen_attention
from .layers import MoE, Reduce, RMSNorm, Rotary, SwiGLU
from .linear import LINEAR_MIXERS, GatedDeltaNet

IGNORE = -100


class Placement(Protocol):
    positions: torch.Tensor  # [n] position of each local token inside its sample
    rotary: Rotary  # cos/sin of those positions, computed once per step
    reduce: Reduce | None  # sums over the global batch (aux loss), identity when local
    total_tokens: int  # tokens of the global batch
    dispatch: object | None  # the rank's expert-parallel group (model.experts.ExpertDispatch); None: its own experts
    pack_backend: str  # the row gathers' and exchanges' kernels (kernels.permute)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_type: str, layer: int, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q [n, H, D], k [n, Hkv, D] (rotary applied), v [n, Hkv, Dv] -> attention output [n, H, Dv]
        for layer type 'F' or 'S'; sinks [H]: the layer's attention sinks, where it has them."""

    def enter(self, x: torch.Tensor, layer_type: str) -> torch.Tensor:
        """x [n, hidden] -> the layer's token-wise layout (the placement's own, or another)."""

    def leave(self, x: torch.Tensor, layer_type: str) -> torch.Tensor:
        """The way back of enter."""

    def rotary_for(self, layer_type: str) -> Rotary:
        """The rotary tables of the layout a layer type's token-wise work runs in."""

    def run_linear(self, mixer: GatedDeltaNet, x: torch.Tensor, layer_type: str) -> torch.Tensor:
        """A linear layer's mixer (LinearBlock) over this process's tokens x [n, hidden] in the
        layer's token layout -> its output [n, hidden], with whatever exchanges the layout needs."""


class LocalPlacement:
    """All samples packed on one process: the single-process reference."""

    def __init__(self, lengths, cfg: ModelConfig, backend: str = "auto", device="cpu", recompute_attention: bool = False):
        self.cfg, self.backend, self.recompute_attention = cfg, backend, recompute_attention
        lengths = [int(n) for n in lengths]
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        self.attention_of = layer_attention(cu, cu, cfg, device)
        self.positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        self.rotary = Rotary(self.positions, cfg.head_dim, cfg.rope_theta, [(0, n) for n in lengths], cfg.rope_scaling, cfg.rotary_dim)
        self.reduce = None
        self.total_tokens = int(sum(lengths))
        self.dispatch, self.pack_backend = None, "auto"
        self.cu_seqlens = cu.tolist()

    def run_linear(self, mixer, x, layer_type):
        """Every sample whole, from a zero state."""
        return mixer(x, self.cu_seqlens, backend=self.backend)[0]

    def enter(self, x, layer_type):
        return x

    def leave(self, x, layer_type):
        return x

    def rotary_for(self, layer_type):
        return self.rotary

    def attend(self, q, k, v, layer_type, layer, sinks=None):
        return self.attention_of[layer_type](q, k, v, self.backend, self.recompute_attention, sinks)


class LayerAttention:
    """How one layer type's attention runs this step: its kind ("full", or the model's sparse
    kind), parameters and cu_seqlens (on the device, with the longest sequence from the host: no
    device sync per layer); keys: a halo child's key segments (its queries' halos first), with a
    chunked kind's segments cut into its aligned chunks here, once."""

    def __init__(self, cu: np.ndarray, kind: str, params: dict | None, device, keys: KeySegments | None = None):
        longest = int(np.diff(cu).max()) if len(cu) > 1 else 0
        if keys is not None and kind != "full" and sparse_kind(kind).split_chunks is not None and sparse_kind(kind).fn is None:
            cu, longest, keys = chunked_key_inputs(cu, keys, sparse_kind(kind).split_chunks(params), device)
            kind = "full"
        elif keys is None:
            cu, longest, kind = kernel_inputs(cu, longest, kind, params)
        self.max_len, self.kind, self.keys = longest, kind, keys
        self.params = params if self.kind != "full" else None
        self.cu = torch.as_tensor(cu, dtype=torch.int32, device=device)

    def __call__(self, q, k, v, backend: str, recompute: bool = False, sinks=None):
        """recompute: keep q, k, v only and re-run the kernel in backward (selective recompute);
        sinks: the attention sinks of the query heads q holds."""
        args = (q, k, v, self.cu, self.max_len, self.kind, self.params, backend, None, self.keys, sinks)
        if recompute and torch.is_grad_enabled():
            return checkpoint(varlen_attention, *args, use_reentrant=False)
        return varlen_attention(*args)


def layer_attention(
    full_cu: np.ndarray, sparse_cu: np.ndarray, cfg: ModelConfig, device, keys: KeySegments | None = None
) -> dict[str, LayerAttention]:
    """Layer type ('F', 'S') -> how its attention runs this step, built once per step (keys: the
    sparse layers' key segments in a halo child)."""
    out = {"F": LayerAttention(full_cu, "full", None, device)}
    if cfg.sparse_kind not in LINEAR_MIXERS:  # a linear kind's S layers run their own mixer (LinearBlock)
        out["S"] = LayerAttention(sparse_cu, cfg.sparse_kind, cfg.sparse_params, device, keys)
    return out


def moe_of(cfg: ModelConfig) -> MoE:
    """A block's MoE as the model's settings make it (its router's and experts' variants, its shared experts)."""
    return MoE(
        cfg.hidden, cfg.expert_ffn, cfg.n_experts, cfg.top_k, router_bias=cfg.router_bias, softmax_topk=cfg.router_softmax_topk,
        shared_ffn=cfg.shared_expert_ffn, shared_gate=cfg.shared_expert_gate, score=cfg.router_score,
        score_bias=cfg.router_score_bias, groups=cfg.router_groups, topk_groups=cfg.router_topk_groups, scaling=cfg.routed_scaling,
        bias=cfg.expert_bias, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha,
    )  # fmt: skip


def norm_of(cfg: ModelConfig, dim: int) -> RMSNorm:
    """An RMSNorm of the model's kind (zero-centered or not) over `dim`."""
    return RMSNorm(dim, cfg.norm_eps, cfg.zero_centered_norm)


class FeedForward(nn.Module):
    """A block's second half, after its attention or linear layer: a norm, then the experts (MoE),
    or one dense SwiGLU in the model's first dense blocks (cfg.first_dense_layers: Kimi Linear's
    first block), which route nothing and add no auxiliary loss."""

    def _feed_forward(self, cfg: ModelConfig, layer: int) -> None:
        self.moe_norm = norm_of(cfg, cfg.hidden)
        dense = layer < cfg.first_dense_layers
        self.moe = None if dense else moe_of(cfg)
        self.mlp = SwiGLU(cfg.hidden, cfg.dense_ffn) if dense else None

    def feed_forward(self, x: torch.Tensor, place: Placement) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (its feed-forward output [n, hidden], the auxiliary loss)."""
        h = self.moe_norm(x)
        if self.moe is None:
            return self.mlp(h), h.new_zeros(())
        return self.moe(h, place.reduce, place.total_tokens, place.dispatch, place.pack_backend)


class LatentProjections(nn.Module):
    """MLA's projections (multi-head latent attention, DeepSeek-V2's, as Kimi Linear builds it):
    the query, full-rank or through a normed latent of q_lora_rank; the key/value down projection
    to a latent of kv_lora_rank (normed) and qk_rope_dim key elements every head shares; the
    latent's up projection to each head's key (its other elements) and value (v_dim). Without
    rotary (Kimi Linear's MLA has none: model.hybrid.check_runnable refuses MLA with one), so the
    shared elements reach the keys as they are. The latents' norms take eps 1e-6, as transformers'
    MLA builds them whatever the model's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.rope, self.dv = cfg.n_heads, cfg.qk_rope_dim, cfg.v_dim
        self.nope, self.rank = cfg.head_dim - cfg.qk_rope_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            self.wq_a, self.q_norm = None, None
            self.wq = nn.Linear(cfg.hidden, cfg.n_heads * cfg.head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.hidden, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_norm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.wq = nn.Linear(cfg.q_lora_rank, cfg.n_heads * cfg.head_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.hidden, cfg.kv_lora_rank + cfg.qk_rope_dim, bias=cfg.attention_bias)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (self.nope + self.dv), bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> q, k [n, H, head_dim], v [n, H, v_dim]."""
        n, h = x.shape[0], self.heads
        q = self.wq(x if self.wq_a is None else self.q_norm(self.wq_a(x))).view(n, h, self.nope + self.rope)
        latent, shared = self.wkv_a(x).split([self.rank, self.rope], dim=-1)
        k, v = self.wkv_b(self.kv_norm(latent)).view(n, h, self.nope + self.dv).split([self.nope, self.dv], dim=-1)
        return q, torch.cat([k, shared[:, None].expand(n, h, self.rope)], dim=-1), v


class Block(FeedForward):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        """layer: the block's index (the first cfg.first_dense_layers are dense)."""
        super().__init__()
        self.cfg = cfg
        self.attn_norm = norm_of(cfg, cfg.hidden)
        if cfg.kv_lora_rank is None:
            qkv = (cfg.n_heads + cfg.n_kv_heads) * cfg.head_dim + cfg.n_kv_heads * cfg.v_dim
            self.wqkv, self.latent = nn.Linear(cfg.hidden, qkv, bias=cfg.attention_bias), None
        else:
            self.wqkv, self.latent = None, LatentProjections(cfg)
        self.wo = nn.Linear(cfg.n_heads * cfg.v_dim, cfg.hidden, bias=cfg.attention_bias)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attention_sinks else None
        # Qwen3-Next's: a norm over each q and k head; a sigmoid gate on the output, one per query element
        self.q_norm, self.k_norm = (norm_of(cfg, cfg.head_dim), norm_of(cfg, cfg.head_dim)) if cfg.qk_norm else (None, None)
        self.wgate = nn.Linear(cfg.hidden, cfg.n_heads * cfg.head_dim, bias=False) if cfg.attn_output_gate else None
        self._feed_forward(cfg, layer)

    def project(self, normed: torch.Tensor, rotary: Rotary | None = None):
        """normed [n, hidden] -> q [n, H, head_dim], k [n, Hkv, head_dim] (each head normed where
        qk_norm, then turned by `rotary` where the model has one), v [n, Hkv, v_dim]."""
        c = self.cfg
        if self.latent is not None:
            return self.latent(normed)
        n, nq = normed.shape[0], c.n_heads + c.n_kv_heads
        qk, v = self.wqkv(normed).split([nq * c.head_dim, c.n_kv_heads * c.v_dim], dim=1)
        qk = qk.view(n, nq, c.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, : c.n_heads]), self.k_norm(qk[:, c.n_heads :])], dim=1)
        if rotary is not None and c.rotary_dim != 0:
            qk = rotary(qk)
        return qk[:, : c.n_heads], qk[:, c.n_heads :], v.view(n, c.n_kv_heads, c.v_dim)

    def forward(self, x: torch.Tensor, place: Placement, layer_type: str, layer: int):
        """x [n, hidden] -> ([n, hidden], aux), in the placement's token layout (a placement may run
        a layer's token-wise work in another: enter and leave move it there and back)."""
        c = self.cfg
        x = place.enter(x, layer_type)
        normed = self.attn_norm(x)
        q, k, v = self.project(normed, place.rotary_for(layer_type))
        o = place.attend(q, k, v, layer_type, layer, self.sinks).reshape(x.shape[0], c.n_heads * c.v_dim)
        if self.wgate is not None:
            o = o * torch.sigmoid(self.wgate(normed))
        x = x + self.wo(o)
        m, aux = self.feed_forward(x, place)
        return place.leave(x + m, layer_type), aux


class LinearBlock(FeedForward):
    """A block whose S layer is linear attention (the model's linear kind: model.linear's Gated
    DeltaNet) in place of attention, then the same feed-forward. The placement runs the mixer
    (Placement.run_linear): on one process every sample whole; across ranks by Ulysses or by
    state passing, as the plan's children say."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        p = sparse_cost(cfg.sparse_kind).resolve(cfg.sparse_params)  # the kind's defaults where a preset leaves one out
        self.cfg = cfg
        self.attn_norm = norm_of(cfg, cfg.hidden)
        self.mixer = LINEAR_MIXERS[cfg.sparse_kind](cfg.hidden, p, cfg.norm_eps)
        self._feed_forward(cfg, layer)

    def forward(self, x: torch.Tensor, place: Placement, layer_type: str, layer: int):
        x = place.enter(x, layer_type)
        x = x + place.run_linear(self.mixer, self.attn_norm(x), layer_type)
        m, aux = self.feed_forward(x, place)
        return place.leave(x + m, layer_type), aux


# the families whose every block the runtime builds: the project's own, gpt-oss (its biases, sinks,
# YaRN rotary, clamped SwiGLU experts and their router are settings of the model here), Qwen3-Next
# (its gated attention, q/k norms, partial rotary, zero-centered norms, shared experts) and Kimi
# Linear (MLA without rotary, KDA layers, a dense first block, a sigmoid router with its bias,
# groups and scaling, a shared expert)
RUNTIME_FAMILIES = ("hybrid", "gpt_oss", "qwen3_next", "kimi_linear")
# what the cost model prices and the runtime does not build: (the model has it, the feature in words)
NOT_BUILT = (
    (lambda m: m.kv_lora_rank is not None and m.rotary_dim != 0, "MLA with a rotary part (DeepSeek's; Kimi Linear's MLA has "
     "none: --rotary-dim 0)"),
    (lambda m: m.kv_lora_rank is not None and m.qk_norm, "q/k head norms on MLA's heads (--qk-norm with --kv-lora-rank)"),
    (lambda m: m.attn_output_gate and m.v_dim != m.head_dim, "the gated attention output with value heads of another size "
     "(--attn-output-gate with --v-head-dim)"),
)  # fmt: skip


def check_runnable(cfg: ModelConfig) -> None:
    """SettingError where the runtime cannot build the model the cost model prices: a Hugging Face
    family's blocks it does not build (model.architecture), or a combination NOT_BUILT lists. The
    simulator prices each of them (the ablation, the sweep, the decision)."""
    if cfg.architecture not in RUNTIME_FAMILIES:
        built = ", ".join(p for p, m in ModelConfig.PRESETS.items() if m.architecture in RUNTIME_FAMILIES)
        raise SettingError(
            f"model {cfg.name}: the runtime does not build {cfg.architecture}'s blocks yet (model.architecture="
            f"{cfg.architecture!r}); the simulator prices them (the ablation, the sweep, experiments.advise), and training "
            f"takes these presets: {built}"
        )
    for has, feature in NOT_BUILT:
        if has(cfg):
            raise SettingError(
                f"model {cfg.name}: the runtime does not build {feature} yet; the simulator prices it (the ablation, the sweep, "
                f"experiments.advise)"
            )


class HybridMoE(nn.Module):
    """>>> from config import ModelConfig
    >>> cfg = ModelConfig.from_name("tiny")
    >>> m = HybridMoE(cfg)
    >>> tokens = torch.randint(0, cfg.vocab, (7,))
    >>> m(tokens, LocalPlacement([4, 3], cfg, "torch"))[0].shape
    torch.Size([7, 64])
    """

    def __init__(self, cfg: ModelConfig, recompute: str = "none"):
        """recompute (as CostsConfig.recompute prices it): "full" re-runs each block's forward,
        exchanges included, in the backward and keeps only its input; "selective" re-runs the
        attention kernels only; "none" keeps every activation."""
        super().__init__()
        check_runnable(cfg)
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute={recompute!r}; valid: {RECOMPUTE}")
        self.cfg, self.recompute = cfg, recompute
        self.ep = 1  # expert-parallel degree (expert_parallel)
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        linear = cfg.sparse_kind in LINEAR_MIXERS  # S layers of a linear kind: LinearBlock, its mixer the kind's
        self.blocks = nn.ModuleList(LinearBlock(cfg, i) if linear and t == "S" else Block(cfg, i) for i, t in enumerate(cfg.layer_types))
        self.norm = norm_of(cfg, cfg.hidden)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def expert_parallel(self, ep: int, rank: int) -> HybridMoE:
        """Keep only the experts of `rank`'s slot in its expert-parallel group of `ep` aligned
        ranks: slot j = rank mod ep holds experts j n_experts / ep onward, n_experts / ep of them
        (the single-process model's tensors, sliced: every rank builds the model from the same
        seed). A step then needs a placement whose dispatch is that group."""
        e = self.cfg.n_experts
        if ep < 1 or e % ep:
            raise ValueError(f"n_experts={e} cannot be split over an expert-parallel group of {ep} ranks")
        if self.ep != 1:
            raise ValueError(f"the experts are already split {self.ep} ways")
        per = e // ep
        for blk in self.blocks:
            if blk.moe is not None:  # a dense first block has no experts
                blk.moe.experts.keep((rank % ep) * per, per)
        self.ep = ep
        return self

    def forward(self, tokens: torch.Tensor, place: Placement, labels=None, label_count: int | None = None, world_size: int = 1):
        """tokens [n] -> (final hidden [n, hidden], summed aux loss); with labels, the loss (see
        `loss`). The loss is computed inside forward so that a sharded root (FSDP2) holds its
        parameters - the embedding, and the head tied to it - for the whole of it."""
        x = self.embed(tokens)
        aux = x.new_zeros(())
        for i, (blk, layer_type) in enumerate(zip(self.blocks, self.cfg.layer_types)):
            if self.recompute == "full" and torch.is_grad_enabled():  # keep the block's input; re-run it in backward
                x, a = checkpoint(blk, x, place, layer_type, i, use_reentrant=False)
            else:
                x, a = blk(x, place, layer_type, i)
            aux = aux + a
        h = self.norm(x)
        if labels is None:
            return h, aux
        logits = self.logits(h)
        if logits.dtype in (torch.float16, torch.bfloat16):  # the softmax of a big vocab wants fp32
            logits = logits.float()
        ce = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")  # fp32 under bf16: so is the loss
        return ce / label_count + self.cfg.aux_loss_coef * aux.to(ce.dtype) / world_size

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.embed.weight.T if self.lm_head is None else self.lm_head(h)

    def loss(self, tokens, labels, place: Placement, label_count: int, world_size: int = 1):
        """This process's share of the global loss: sum of next-token CE over its tokens / the global
        number of labelled tokens, plus aux_loss_coef x aux / world_size (summed over ranks, the
        global loss)."""
        return self(tokens, place, labels, label_count, world_size)


def next_token_labels(sample_tokens: list[np.ndarray]) -> list[np.ndarray]:
    """Labels per sample: the next token inside the same sample; the last token has none."""
    return [np.concatenate([t[1:], [IGNORE]]).astype(np.int64) for t in sample_tokens]
