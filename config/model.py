"""The model section: the hybrid 1F3S MoE's shapes, with named presets."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

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
        "heads of 192); priced by the simulator, refused by the runtime, whose attention takes one head size",
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

    def merge(self, changes: dict) -> dict:
        """A new sparse kind starts from that kind's parameters (its declared defaults, unless
        given); parameters given for the same kind add to this config's."""
        kind = changes.get("sparse_kind", self.sparse_kind)
        if kind != self.sparse_kind:
            return {"sparse_params": {}, **changes}
        if "sparse_params" in changes:
            return {**changes, "sparse_params": {**self.sparse_params, **changes["sparse_params"]}}
        return changes

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

# Gated DeltaNet hybrids: three linear layers, then one full-attention layer (SSSF, as Qwen3-Next
# orders them). paper-gdn: Qwen3-Next-80B-A3B's shapes (docs/cost-model.md lists each with its
# source; its shared expert and partial rotary are left out, as the paper preset leaves out what
# the hybrid MoE here does not model); tiny-gdn: tiny's shapes with small linear layers
ModelConfig.PRESETS["paper-gdn"] = ModelConfig(
    name="paper-gdn",
    n_layers=48,
    layer_pattern="SSSF",
    hidden=2048,
    n_heads=16,
    n_kv_heads=2,
    head_dim=256,
    n_experts=512,
    top_k=10,
    expert_ffn=512,
    vocab=151936,
    sparse_kind="gated_delta",
    sparse_params={
        "k_heads": 16,
        "v_heads": 32,
        "head_k_dim": 128,
        "head_v_dim": 128,
        "conv_kernel": 4,
        "block": 64,
        "state_dtype": "auto",
    },
    rope_theta=1e7,
)
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
# paper-kda: Kimi-Linear-48B-A3B's shapes (Moonshot AI, 2025; its public config.json): 27 layers,
# KDA at layers 1-3, 5-7, ... 25-26 and MLA full attention at 4, 8, ..., 24 and 27 (1-based, as its
# layer list places them); hidden size 2304; KDA of 32 heads of 128 and a convolution of 4; MLA's
# 32 heads priced by their head sizes, q/k 192 (128 without rotary + 64 with) and v 128; 256
# routed experts, 8 a token, each a SwiGLU of 1024; a vocabulary of 163,840. Its dense first layer
# and its shared expert are left out, and MLA's low-rank key/value projection is priced as the
# full-rank one of these head sizes (docs/cost-model.md)
ModelConfig.PRESETS["paper-kda"] = ModelConfig(
    name="paper-kda",
    n_layers=27,
    layer_pattern="SSSF" * 6 + "SSF",
    hidden=2304,
    n_heads=32,
    n_kv_heads=32,
    head_dim=192,
    v_head_dim=128,
    n_experts=256,
    top_k=8,
    expert_ffn=1024,
    vocab=163840,
    sparse_kind="kda",
    sparse_params={
        "k_heads": 32, "v_heads": 32, "head_k_dim": 128, "head_v_dim": 128, "conv_kernel": 4, "block": 64, "gate_rank": 128,
        "state_dtype": "auto",
    },
    rope_theta=1e4,
)  # fmt: skip
