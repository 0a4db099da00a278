"""Model and hardware configs with named presets (shared by the model, solvers and simulator).

Every number of the paper-scale presets is sourced or reasoned in the README's "Defaults" table.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from .cluster import PlanError, check_fraction, check_non_negative, check_positive, check_positive_int

LAYER_KINDS = ("F", "S")  # F: full causal attention; S: sparse attention of `sparse_kind`


class _Config:
    """replace / to_dict shared by the config dataclasses."""

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _preset(presets: dict, kind: str, name: str, overrides: dict):
    if name not in presets:
        raise PlanError(f"unknown {kind} preset {name!r}; valid presets: {sorted(presets)}")
    return presets[name].replace(**overrides) if overrides else presets[name]


@dataclass(frozen=True)
class ModelConfig(_Config):
    name: str = "paper"
    n_layers: int = 48
    layer_pattern: str = "FSSS"  # tiled over n_layers: one full : three sparse
    hidden: int = 4096
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    n_experts: int = 128
    top_k: int = 8
    expert_ffn: int = 1536
    vocab: int = 151936
    sparse_kind: str = "sliding_window"
    sparse_params: dict = field(default_factory=lambda: {"window": 4096}, hash=False, compare=True)
    tie_embeddings: bool = False
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    aux_loss_coef: float = 0.0

    def __post_init__(self):
        if not self.layer_pattern or any(c not in LAYER_KINDS for c in self.layer_pattern):
            raise PlanError(f"layer_pattern={self.layer_pattern!r}: use a string of 'F' (full) and 'S' (sparse)")
        if self.n_layers % len(self.layer_pattern):
            raise PlanError(f"n_layers={self.n_layers} is not a multiple of len(layer_pattern={self.layer_pattern!r})")
        if self.n_heads % self.n_kv_heads:
            raise PlanError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.top_k > self.n_experts:
            raise PlanError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")

    # cached: the solvers read these in their inner loops (the fields are frozen)
    @functools.cached_property
    def layer_kinds(self) -> str:
        return self.layer_pattern * (self.n_layers // len(self.layer_pattern))

    @functools.cached_property
    def n_full(self) -> int:
        return self.layer_kinds.count("F")

    @functools.cached_property
    def n_sparse(self) -> int:
        return self.layer_kinds.count("S")

    @staticmethod
    def from_name(name: str, **overrides) -> ModelConfig:
        return _preset(MODEL_PRESETS, "model", name, overrides)


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Attention and MoE shapes of a public 2025 frontier MoE (hidden 4096, 128 experts top-8,
    # expert FFN 1536, head_dim 128, vocab 151936), 48 layers in 1F3S, sliding window 4096.
    "paper": ModelConfig(),
    # For real multi-node runs of the training driver with replicated parameters (~0.5B): every
    # head count divides 32, so SP32 parents work.
    "small": ModelConfig(
        name="small",
        n_layers=8,
        layer_pattern="FSSS",
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
    # Runs a step on CPU in well under a second; heads divisible by groups up to 8 ranks.
    "tiny": ModelConfig(
        name="tiny",
        n_layers=4,
        layer_pattern="FSSS",
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
        norm_eps=1e-6,
    ),
}


@dataclass(frozen=True)
class HardwareConfig(_Config):
    name: str = "h100"
    peak_flops: float = 989e12  # dense bf16 per GPU, H100 SXM datasheet
    gemm_efficiency: float = 0.70  # achieved / peak for large bf16 GEMMs and grouped expert GEMMs
    attention_efficiency: float = 0.55  # achieved / peak of varlen flash attention, fwd+bwd mixed
    intra_node_bw: float = 150e9  # effective all-to-all bytes/s per GPU over NVLink
    inter_intra_ratio: float = 7.0  # intra / inter effective all-to-all rate: the paper's figure
    # What the ratio compares (DESIGN.md section 7). "group": an all-to-all whose group spans nodes
    # runs, as a whole, at 1/ratio of the rate of one inside a node: the paper's "observed
    # effective all-to-all rate", the reading of FlexSP's measured whole-group figures. "link": an
    # inter-node byte costs ratio x an intra-node byte, each peer's bytes at its link's rate.
    ratio_reading: str = "group"
    a2a_latency: float = 25e-6  # fixed cost of one all-to-all call (launch + sync), seconds
    # What an all-to-all whose group spans nodes pays on top of a2a_latency per call (the network's
    # round trip and its proxies), seconds; 0 unless measured (experiments.calibrate fits it).
    a2a_inter_latency: float = 0.0
    bytes_per_element: int = 2  # bf16 activations
    hbm_bw: float = 3.35e12  # device memory bytes/s, H100 SXM datasheet (the optimizer step is memory-bound)
    # Fixed costs that FLOPs and bytes do not show, 0 unless measured (experiments.calibrate fits
    # them): seconds of one layer's forward on every rank whatever its tokens (kernel launches,
    # host dispatch; the backward counts twice), and the latency of one collective of the
    # parameters' gather and gradients' reduction (three per sharded block and step).
    layer_overhead: float = 0.0
    collective_latency: float = 0.0

    def __post_init__(self):
        for f in ("peak_flops", "gemm_efficiency", "attention_efficiency", "intra_node_bw", "inter_intra_ratio", "hbm_bw"):
            check_positive(f, getattr(self, f))
        for f in ("a2a_latency", "a2a_inter_latency", "layer_overhead", "collective_latency"):
            check_non_negative(f, getattr(self, f))
        if self.gemm_efficiency > 1 or self.attention_efficiency > 1:
            raise PlanError("efficiencies are fractions of peak: use values in (0, 1]")
        if self.ratio_reading not in RATIO_READINGS:
            raise PlanError(f"ratio_reading={self.ratio_reading!r}; valid: {RATIO_READINGS}")

    @property
    def inter_node_bw(self) -> float:
        return self.intra_node_bw / self.inter_intra_ratio

    @staticmethod
    def from_name(name: str, **overrides) -> HardwareConfig:
        """A preset by name, or a hardware profile written by experiments.calibrate (a .json path)."""
        if name.endswith(".json"):
            return HardwareConfig.from_profile(name, **overrides)
        return _preset(HARDWARE_PRESETS, "hardware", name, overrides)

    @staticmethod
    def from_profile(path: str, **overrides) -> HardwareConfig:
        """The hardware of a profile (experiments.calibrate): its "hardware" section, checked field
        by field like any config."""
        import json  # noqa: PLC0415

        try:
            with open(path) as f:
                obj = json.load(f)
        except OSError as e:
            raise PlanError(f"hardware profile {path!r} cannot be read: {e.strerror or e}") from None
        except ValueError as e:
            raise PlanError(f"hardware profile {path!r} is not JSON: {e}") from None
        section = obj.get("hardware") if isinstance(obj, dict) else None
        if not isinstance(section, dict):
            raise PlanError(f"hardware profile {path!r} has no 'hardware' object (write one with python -m experiments.calibrate)")
        known = {f.name for f in dataclasses.fields(HardwareConfig)}
        bad = sorted(set(section) - known)
        if bad:
            raise PlanError(f"hardware profile {path!r}: {bad[0]!r} is not a hardware setting; valid: {sorted(known)}")
        return HardwareConfig(**{**section, **overrides})


RATIO_READINGS = ("group", "link")
RECOMPUTE = ("full", "selective", "none")
EP_PLACEMENTS = ("intra", "inter")


@dataclass(frozen=True)
class TrainingConfig(_Config):
    """Costs every mode pays (DESIGN.md section 7): each a switch with a sourced default (README).

    They do not depend on which layout a sample's tokens take, but they are in the denominator of
    every relative gain and of MFU, so leaving them out inflates both."""

    # Activation recompute, as the per-rank token budget assumes (32K tokens of a 4096-wide MoE
    # per GPU need it): "full" re-runs each layer's forward, exchanges included, in backward;
    # "selective" re-runs attention only (Korthikanti et al. 2022); "none".
    recompute: str = "full"
    # The MoE experts' dispatch and combine all-to-all: expert-parallel degree, whether an EP group
    # sits inside a node or spans nodes, and the share of its time hidden behind compute.
    moe_all_to_all: bool = True
    ep_degree: int = 8
    ep_placement: str = "intra"
    moe_overlap: float = 0.8
    # Gradient reduce-scatter and parameter all-gather over the data-parallel ranks (every rank:
    # Ulysses ranks shard like data-parallel ranks), fp32 gradients and bf16 parameters, with
    # the share hidden behind backward and forward.
    grad_sync: bool = True
    grad_bytes: int = 4
    param_bytes: int = 2
    grad_sync_overlap: float = 0.8
    # The optimizer step (AdamW) on each rank's shard: memory-bound, bytes read and written per
    # parameter (fp32 master weight, gradient and two moments read; weight, moments and the bf16
    # copy written).
    optimizer: bool = True
    optimizer_bytes_per_param: float = 30.0
    # The router's load-balancing statistics (per-expert token counts and probability mass) summed
    # over the world at every MoE layer, as the runtime does for a loss equal to one process's
    # (model.layers.MoE): two all-reduces in each forward (and in full recompute's), one in the
    # backward. Each is a world barrier: a rank waits there for the slowest, layer by layer, so
    # imbalance is paid per layer and not once per step. Each costs HardwareConfig.collective_latency.
    router_sync: bool = True

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise PlanError(f"recompute={self.recompute!r}; valid: {RECOMPUTE}")
        if self.ep_placement not in EP_PLACEMENTS:
            raise PlanError(f"ep_placement={self.ep_placement!r}; valid: {EP_PLACEMENTS}")
        check_positive_int("ep_degree", self.ep_degree)
        for f in ("moe_overlap", "grad_sync_overlap"):
            check_fraction(f, getattr(self, f))
        for f in ("grad_bytes", "param_bytes", "optimizer_bytes_per_param"):
            check_positive(f, getattr(self, f))

    @staticmethod
    def from_name(name: str, **overrides) -> TrainingConfig:
        return _preset(TRAINING_PRESETS, "training", name, overrides)


TRAINING_PRESETS: dict[str, TrainingConfig] = {
    "default": TrainingConfig(),
    # the first simulator's accounting: no recompute, no expert all-to-all, no gradient sync or optimizer
    "bare": TrainingConfig(recompute="none", moe_all_to_all=False, grad_sync=False, optimizer=False, router_sync=False),
}


HARDWARE_PRESETS: dict[str, HardwareConfig] = {
    "h100": HardwareConfig(),
    "h200": HardwareConfig(name="h200"),  # same compute and links as H100 SXM; more HBM
}

# tiny with grouped-query attention, 8 query / 2 key-value heads: SP4 and SP8 groups replicate
# each key/value head over 2 and 4 ranks
MODEL_PRESETS["tiny-gqa"] = MODEL_PRESETS["tiny"].replace(name="tiny-gqa", n_kv_heads=2)
