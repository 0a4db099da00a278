"""The model section: the hybrid 1F3S MoE's shapes, with named presets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from .base import NON_EMPTY, Check, Section, SettingError, int_in, number_in, optional, setting

LAYER_TYPES = ("F", "S")  # F: full causal attention; S: sparse attention of the model's sparse kind
QWEN3 = "attention and MoE shapes of Qwen3-235B-A22B (2025)"
# Each shape's largest value: past every published model's (hidden 16,384 and 256 experts of 2025's
# largest MoEs, vocabularies up to about 260K) by far, so only a typo is refused; a combination
# whose parameters could not fit any supported cluster is refused by experiments.common.settings
MAX_HIDDEN = 1 << 17
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 12
MAX_EXPERTS = 1 << 14
MAX_FFN = 1 << 18
MAX_VOCAB = 1 << 24
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate")  # rope_scaling's
QWEN3_NEXT = "Qwen3-Next-80B-A3B (2025)"  # its config: docs/cost-model.md lists each shape the paper-gdn preset takes


@dataclass(frozen=True)
class ModelConfig(Section):
    """The model's shapes. The `paper` preset takes the attention and MoE shapes of a public 2025
    MoE with 48 layers in the paper's 1F3S pattern; `small` trains on a GPU cluster; `tiny` and
    `tiny-gqa` run a step on a CPU in well under a second. `paper-gdn` and `tiny-gdn`: hybrids
    whose S layers are Gated DeltaNet (the linear kind `gated_delta`), the first with the shapes of
    a public 2025 GDN hybrid; across ranks their S layers run by Ulysses or by state passing."""

    SECTION = "model"

    name: str = setting("paper", "the preset these shapes came from (results carry it)", cli=False)
    n_layers: int = setting(48, "transformer blocks", int_in(1, 100_000), source="the paper's 1F3S pattern at 48 layers")
    layer_pattern: str = setting(
        "FSSS",
        "layer types tiled over the blocks: F full causal attention, S sparse attention",
        Check("a non-empty string of 'F' and 'S'", lambda v: isinstance(v, str) and v != "" and set(v) <= set(LAYER_TYPES)),
        source="the paper: one full layer per three sparse",
    )
    hidden: int = setting(4096, "hidden size", int_in(1, MAX_HIDDEN), source=QWEN3)
    n_heads: int = setting(32, "query heads", int_in(1, MAX_HEADS), source=QWEN3)
    n_kv_heads: int = setting(
        8, "key/value heads (grouped-query attention when fewer than the query heads)", int_in(1, MAX_HEADS), source=QWEN3
    )
    head_dim: int = setting(128, "size of one attention head", int_in(1, MAX_HEAD_DIM), source=QWEN3)
    v_head_dim: int = setting(
        None,
        "size of one value head and of the attention's output head, where it differs from head_dim (MLA's: 128 beside q/k "
        "heads of 192); the runtime's attention runs them on its torch path",
        optional(int_in(1, MAX_HEAD_DIM)),
        type_=int,
    )
    n_experts: int = setting(128, "routed experts per MoE layer", int_in(1, MAX_EXPERTS), source=QWEN3)
    top_k: int = setting(8, "experts each token is routed to", int_in(1, MAX_EXPERTS), source=QWEN3)
    expert_ffn: int = setting(1536, "hidden size of one expert's SwiGLU", int_in(1, MAX_FFN), source=QWEN3)
    vocab: int = setting(151936, "vocabulary size", int_in(1, MAX_VOCAB), source=QWEN3)
    sparse_kind: str = setting(
        "sliding_window", "the registered sparse-attention kind of the S layers", NON_EMPTY, source="Mistral 7B's sliding window"
    )
    sparse_params: dict = setting(
        {"window": 4096},
        "the sparse kind's parameters, as key=value pairs; a kind declares them with their defaults",
        Check("an object of parameter names and numbers", lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v)),
        source="Mistral 7B's window of 4096",
    )
    shared_expert_ffn: int = setting(
        0,
        "hidden size of the shared experts' SwiGLU, which every token runs beside its routed experts (several shared experts: "
        "their widths summed); 0: none",
        int_in(0, MAX_FFN),
    )
    shared_expert_gate: bool = setting(False, "a sigmoid gate of one output scales the shared experts' output (Qwen3-Next's)")
    first_dense_layers: int = setting(
        0, "the first blocks whose feed-forward is one dense SwiGLU instead of the experts (Kimi Linear's first)", int_in(0, 100_000)
    )
    dense_ffn: int = setting(0, "hidden size of those dense blocks' SwiGLU", int_in(0, MAX_FFN))
    attn_output_gate: bool = setting(
        False,
        "full attention's output is scaled by a sigmoid gate projected from the hidden state, one per query element "
        "(Qwen3-Next's gated attention): the query projection is twice as wide",
    )
    kv_lora_rank: int = setting(
        None,
        "MLA's latent: keys and values are projected down to this width (beside qk_rope_dim rotary key elements every head "
        "shares), then up to each head; unset: full-rank key/value projections",
        optional(int_in(1, MAX_HIDDEN)),
        type_=int,
    )
    q_lora_rank: int = setting(
        None, "MLA's query latent (queries projected down to this width, then up); unset: a full-rank query projection",
        optional(int_in(1, MAX_HIDDEN)), type_=int,
    )  # fmt: skip
    qk_rope_dim: int = setting(
        0, "MLA: the rotary elements of each q/k head (part of head_dim), the key's shared by every head", int_in(0, MAX_HEAD_DIM)
    )
    qk_norm: bool = setting(False, "an RMSNorm over each query and key head before the rotary embedding (Qwen3-Next's)")
    zero_centered_norm: bool = setting(
        False, "every RMSNorm but a linear layer's output norm scales by 1 + its weight, the weight starting at 0 (Qwen3-Next's)"
    )
    rotary_dim: int = setting(
        None,
        "the leading elements of each q/k head the rotary embedding turns (Qwen3-Next's partial rotary: 64 of 256); 0: none "
        "(Kimi Linear's MLA has no position embedding); unset: all",
        optional(int_in(0, MAX_HEAD_DIM)),
        type_=int,
    )
    attention_bias: bool = setting(False, "the attention's q, k, v and output projections carry biases (gpt-oss's)")
    attention_sinks: bool = setting(
        False, "a learned sink logit per query head joins each softmax, taking weight from the keys (gpt-oss's)"
    )
    rope_scaling: dict = setting(
        {},
        "rotary scaling, as key=value pairs: none, or YaRN's factor, original_max_position_embeddings, beta_fast, beta_slow "
        "and truncate (gpt-oss's)",
        Check("an object of YaRN's parameters", lambda v: isinstance(v, dict) and set(v) <= set(YARN_KEYS)),
    )
    router_bias: bool = setting(False, "the router's logits carry a bias (gpt-oss's)")
    router_softmax_topk: bool = setting(
        False, "weight a token's experts by the softmax of their top-k logits (gpt-oss's), not the renormalized top-k of the softmax"
    )
    router_score: str = setting(
        "softmax",
        "how the router scores experts: softmax over every expert's logit, or sigmoid of each (Kimi Linear's, DeepSeek-V3's: "
        "a token's top-k scores then renormalized to sum to 1)",
        Check("'softmax' or 'sigmoid'", lambda v: v in ("softmax", "sigmoid")),
    )
    router_score_bias: bool = setting(
        False,
        "a per-expert bias added to the scores to choose the top-k experts only, their weights left unbiased (Kimi Linear's "
        "e_score_correction_bias: a buffer, loaded and saved, not trained by the gradient)",
    )
    router_groups: int = setting(
        1, "the experts in this many equal groups; a token chooses among the router_topk_groups groups whose two best scores sum "
        "highest (Kimi Linear's n_group)", int_in(1, MAX_EXPERTS),
    )  # fmt: skip
    router_topk_groups: int = setting(
        1, "the groups a token's experts are chosen from (read where router_groups > 1)", int_in(1, MAX_EXPERTS)
    )
    routed_scaling: float = setting(
        1.0, "the routed experts' weights are scaled by this (Kimi Linear's routed_scaling_factor)", number_in(0, 1e6, lo_open=True)
    )
    expert_bias: bool = setting(False, "the experts' projections carry biases (gpt-oss's)")
    swiglu_limit: float = setting(
        None,
        "the clamped SwiGLU of gpt-oss's experts: gate clamped to at most this, up to within it, out = (up + 1) x gate x "
        "sigmoid(swiglu_alpha x gate); unset: the plain SwiGLU",
        optional(number_in(0, 1e6, lo_open=True)),
        type_=float,
    )
    swiglu_alpha: float = setting(
        1.702, "the clamped SwiGLU's sigmoid slope (read where swiglu_limit is set)", number_in(0, 1e6, lo_open=True)
    )
    architecture: str = setting(
        "hybrid",
        "the family whose blocks these are: hybrid (the project's own) or a Hugging Face model_type read by --model hf:DIR "
        "(config.hf); the runtime builds the project's own",
        NON_EMPTY,
        cli=False,
    )
    tie_embeddings: bool = setting(False, "the LM head shares the embedding's weights")
    rope_theta: float = setting(1e6, "rotary base", number_in(0, 1e12, lo_open=True), source=QWEN3)
    norm_eps: float = setting(1e-6, "RMSNorm epsilon", number_in(0, 1, lo_open=True))
    aux_loss_coef: float = setting(
        0.0, "weight of the router's load-balancing loss", number_in(0, 1e308)
    )  # any finite weight: one past float32's range overflows the loss, which the run refuses at its step

    def check(self) -> None:
        if self.n_layers % len(self.layer_pattern):
            raise SettingError(
                f"{self.spelt('n_layers')}={self.n_layers} is not a multiple of the length of "
                f"{self.spelt('layer_pattern')}={self.layer_pattern!r}"
            )
        if self.n_heads % self.n_kv_heads:
            raise SettingError(f"{self.spelt('n_heads')}={self.n_heads} is not a multiple of {self.spelt('n_kv_heads')}={self.n_kv_heads}")
        if self.top_k > self.n_experts:
            raise SettingError(f"{self.spelt('top_k')}={self.top_k} exceeds {self.spelt('n_experts')}={self.n_experts}")
        if self.rotary_dim is not None and (self.rotary_dim > self.head_dim or self.rotary_dim % 2):
            raise SettingError(
                f"{self.spelt('rotary_dim')}={self.rotary_dim} must be even and at most {self.spelt('head_dim')}={self.head_dim}"
            )
        if self.first_dense_layers > self.n_layers:
            raise SettingError(
                f"{self.spelt('first_dense_layers')}={self.first_dense_layers} exceeds {self.spelt('n_layers')}={self.n_layers}"
            )
        if self.first_dense_layers and not self.dense_ffn:
            raise SettingError(
                f"{self.spelt('first_dense_layers')}={self.first_dense_layers} needs {self.spelt('dense_ffn')}, the dense "
                f"SwiGLU's hidden size (it is 0)"
            )
        if self.shared_expert_gate and not self.shared_expert_ffn:
            raise SettingError(f"{self.spelt('shared_expert_gate')} gates shared experts, but {self.spelt('shared_expert_ffn')} is 0")
        if self.n_experts % self.router_groups:
            raise SettingError(
                f"{self.spelt('router_groups')}={self.router_groups} does not divide {self.spelt('n_experts')}={self.n_experts}"
            )
        if self.router_groups > 1:
            per = self.n_experts // self.router_groups
            if self.router_topk_groups > self.router_groups or per < 2 or self.top_k > self.router_topk_groups * per:
                raise SettingError(
                    f"{self.spelt('router_topk_groups')}={self.router_topk_groups} of {self.spelt('router_groups')}="
                    f"{self.router_groups} groups of {per} experts: a group is scored by its two best experts, at most every "
                    f"group is chosen, and the chosen groups must hold {self.spelt('top_k')}={self.top_k} experts"
                )
        if self.kv_lora_rank is None:
            for name in ("q_lora_rank", "qk_rope_dim"):
                if getattr(self, name):
                    raise SettingError(f"{self.spelt(name)}={getattr(self, name)} is MLA's; set {self.spelt('kv_lora_rank')} with it")
        else:
            if self.n_kv_heads != self.n_heads:
                raise SettingError(
                    f"{self.spelt('kv_lora_rank')} (MLA) projects a key and a value for every query head: "
                    f"{self.spelt('n_kv_heads')}={self.n_kv_heads} must equal {self.spelt('n_heads')}={self.n_heads}"
                )
            if self.qk_rope_dim >= self.head_dim:
                raise SettingError(
                    f"{self.spelt('qk_rope_dim')}={self.qk_rope_dim} must be less than {self.spelt('head_dim')}={self.head_dim}, "
                    f"of which it is the rotary part"
                )

    # readers of a model named by a prefix (config.hf registers "hf:", a Hugging Face config.json)
    READERS: ClassVar[dict[str, Callable[[str], ModelConfig]]] = {}

    @classmethod
    def from_name(cls, name: str, **overrides) -> ModelConfig:
        """A preset by name, or a model a reader reads (hf:DIR: a Hugging Face config, config.hf)."""
        for prefix, reader in cls.READERS.items():
            if name.startswith(prefix):
                model = reader(name)
                return model.replace(**overrides) if overrides else model
        return super().from_name(name, **overrides)

    def merge(self, changes: dict) -> dict:
        """A new sparse kind starts from that kind's parameters (its declared defaults, unless
        given); parameters given for the same kind add to this config's."""
        kind = changes.get("sparse_kind", self.sparse_kind)
        if kind != self.sparse_kind:
            return {"sparse_params": {}, **changes}
        if "sparse_params" in changes:
            return {**changes, "sparse_params": {**self.sparse_params, **changes["sparse_params"]}}
        return changes

    def differing(self, other: ModelConfig) -> list[str]:
        """The settings, name aside, whose values differ between this model and `other`."""
        return sorted(k for k in self.settings() if k != "name" and getattr(self, k) != getattr(other, k))

    def describe(self) -> str:
        """Its shapes in one line, each that moves a priced figure (what a run prints beside its model)."""
        heads = f"{self.n_heads} q / {self.n_kv_heads} kv heads of {self.head_dim}" + (
            f" (v {self.v_dim})" if self.v_dim != self.head_dim else ""
        )
        parts = [f"{self.n_layers} layers {self.layer_pattern}", f"hidden {self.hidden}", f"attention {heads}"]
        if self.attn_output_gate:
            parts.append("gated attention output")
        if self.kv_lora_rank is not None:
            q = "" if self.q_lora_rank is None else f", q latent {self.q_lora_rank}"
            parts.append(f"MLA kv latent {self.kv_lora_rank} + rope {self.qk_rope_dim}{q}")
        parts.append(f"{self.n_experts} experts of {self.expert_ffn}, top-{self.top_k}")
        if self.shared_expert_ffn:
            parts.append(f"shared expert {self.shared_expert_ffn}" + (" (gated)" if self.shared_expert_gate else ""))
        if self.first_dense_layers:
            parts.append(f"first {self.first_dense_layers} block(s) dense of {self.dense_ffn}")
        parts.append(f"vocab {self.vocab}")
        return ", ".join(parts)

    @property
    def v_dim(self) -> int:
        """The value (and attention output) head size: v_head_dim, or head_dim where unset."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    # cached: the solvers read these in their inner loops (the fields are frozen)
    @cached_property
    def layer_types(self) -> str:
        """The type of every layer, in order: layer_pattern tiled over n_layers."""
        return self.layer_pattern * (self.n_layers // len(self.layer_pattern))

    @cached_property
    def n_full(self) -> int:
        return self.layer_types.count("F")

    @cached_property
    def n_sparse(self) -> int:
        return self.layer_types.count("S")

    @cached_property
    def n_moe(self) -> int:
        """Blocks whose feed-forward is the experts (all but the first dense ones)."""
        return self.n_layers - self.first_dense_layers

    def n_dense_of(self, layer_type: str) -> int:
        """The dense blocks among the layers of `layer_type`."""
        return self.layer_types[: self.first_dense_layers].count(layer_type)


ModelConfig.PRESETS = {
    "paper": ModelConfig(),
    # real multi-node runs of the training driver (~0.5B): every head count divides 32, so SP32 parents work
    "small": ModelConfig(
        name="small",
        n_layers=8,
        hidden=1024,
        n_heads=32,
        n_kv_heads=32,
        head_dim=32,
        n_experts=16,
        top_k=2,
        expert_ffn=1024,
        vocab=32000,
        sparse_params={"window": 1024},
        rope_theta=1e4,
    ),
    # a step on a CPU in well under a second; heads divisible by groups up to 8 ranks
    "tiny": ModelConfig(
        name="tiny",
        n_layers=4,
        hidden=64,
        n_heads=8,
        n_kv_heads=8,
        head_dim=8,
        n_experts=4,
        top_k=2,
        expert_ffn=32,
        vocab=97,
        sparse_params={"window": 8},
        rope_theta=1e4,
    ),
}
# tiny with grouped-query attention, 8 query / 2 key-value heads: SP4 and SP8 groups replicate
# each key/value head over 2 and 4 ranks
ModelConfig.PRESETS["tiny-gqa"] = ModelConfig.PRESETS["tiny"].replace(name="tiny-gqa", n_kv_heads=2)

# Gated DeltaNet hybrids the runtime trains: tiny-gdn, tiny's shapes with small linear layers in
# Qwen3-Next's order (three linear layers, then one full-attention layer)
ModelConfig.PRESETS["tiny-gdn"] = ModelConfig.PRESETS["tiny"].replace(
    name="tiny-gdn",
    layer_pattern="SSSF",
    sparse_kind="gated_delta",
    sparse_params={"k_heads": 4, "v_heads": 8, "head_k_dim": 8, "head_v_dim": 8, "conv_kernel": 4, "block": 16, "state_dtype": "auto"},
)
# Kimi Delta Attention hybrids (the linear kind `kda`): tiny-kda, tiny-gdn with KDA layers of the
# same heads, their gates' bottleneck one head wide
ModelConfig.PRESETS["tiny-kda"] = ModelConfig.PRESETS["tiny-gdn"].replace(
    name="tiny-kda", sparse_kind="kda", sparse_params={**ModelConfig.PRESETS["tiny-gdn"].sparse_params, "gate_rank": 8}
)
