"""The costs section: what every step pays whatever its layout, each a switch with a sourced default.

They do not depend on which layout a sample's tokens take, but they are in the denominator of
every relative gain and of MFU, so leaving them out inflates both."""

from __future__ import annotations

from dataclasses import dataclass

from .base import FRACTION, Section, SettingError, int_in, number_in, optional, power_of_two, profile_section, setting
from .model import MAX_EXPERTS

RECOMPUTE = ("full", "selective", "none")
EP_PLACEMENTS = ("intra", "inter")


@dataclass(frozen=True)
class CostsConfig(Section):
    """The costs every mode pays (preset `default`); preset `bare` leaves them all out, the first
    simulator's accounting."""

    SECTION = "costs"

    recompute: str = setting(
        "full",
        "activation recompute: full re-runs each layer's forward (exchanges too) in backward; selective re-runs attention only",
        choices=RECOMPUTE,
        source="a 32K-token budget of a 4096-wide MoE per GPU needs it (Korthikanti et al. 2022)",
    )
    moe_all_to_all: bool = setting(
        True, "price the experts' dispatch and combine all-to-all", source="top-8 at hidden 4096 moves ~8x a Ulysses exchange's bytes"
    )
    ep_degree: int = setting(
        None,
        "expert-parallel degree: ranks that share one layer's experts, each holding n_experts / ep of them (default: a node's "
        "ranks, at most 8, dividing the experts; 1: every rank holds every expert)",
        optional(power_of_two(MAX_EXPERTS)),
        type_=int,
        flag="--ep",
        source="EP8: one node's GPUs",
    )
    ep_placement: str = setting(
        "intra",
        "an expert-parallel group of aligned ranks inside a node (intra: the EP degree at most a node) or across nodes (inter: wider)",
        choices=EP_PLACEMENTS,
    )
    moe_overlap: float = setting(
        0.8, "share of the experts' all-to-all hidden behind compute", FRACTION,
        source="production MoE systems overlap most of it (DeepSeek-V3 reports near-full overlap)",
    )  # fmt: skip
    grad_sync: bool = setting(True, "price the gradient reduce-scatter and parameter all-gather over the data-parallel ranks")
    grad_bytes: int = setting(4, "bytes of one gradient element in the reduction (fp32)", int_in(1, 8))
    param_bytes: int = setting(2, "bytes of one parameter element in the gather (bf16)", int_in(1, 8))
    grad_sync_overlap: float = setting(
        0.8, "share of the gradient sync hidden behind backward and forward", FRACTION,
        source="FSDP/ZeRO-3 overlap both; the first gather and the last reduction stay exposed",
    )  # fmt: skip
    optimizer: bool = setting(True, "price the optimizer step on each rank's shard")
    optimizer_bytes_per_param: float = setting(
        30.0, "bytes the optimizer moves per parameter", number_in(0, 1e6, lo_open=True),
        source="AdamW: fp32 weight, gradient and two moments read; weight, moments and the bf16 copy written",
    )  # fmt: skip
    overlap_blocks: int = setting(
        1,
        "head blocks each attention layer's exchanges are pipelined in, a block's exchange under another block's attention "
        "(every mode alike: a full layer's all-to-alls, a Ulysses child's, a halo child's point-to-point sends; each block a call "
        "of its own). 1: none, every exchange exposed. A priced what-if: the runtime does not pipeline (docs/cost-model.md)",
        int_in(1, 64),
        source="head-blocked Ulysses all-to-alls, as frameworks overlap them with attention; 1 is the paper's accounting",
    )
    router_sync: bool = setting(
        True, "the router's statistics are all-reduced over the world at every MoE layer (a barrier per layer)",
        source="what the runtime does, so a distributed step's loss equals one process's (model/layers.py)",
    )  # fmt: skip

    @classmethod
    def from_name(cls, name: str, **overrides) -> CostsConfig:
        """A preset by name, or a profile written by experiments.calibrate (a .json path): the
        default preset with the costs the calibration measured (its "costs" section)."""
        if not name.endswith(".json"):
            return super().from_name(name, **overrides)
        section = profile_section(name, "costs")
        where = f"costs profile {name!r}: "
        cls.unknown(section, where)
        try:
            return cls.PRESETS["default"].replace(**{**section, **overrides})
        except SettingError as e:
            raise SettingError(f"{where}{e}") from None


CostsConfig.PRESETS = {
    "default": CostsConfig(),
    # the first simulator's accounting: no recompute, no experts' all-to-all, gradient sync, optimizer or router barrier
    "bare": CostsConfig(recompute="none", moe_all_to_all=False, grad_sync=False, optimizer=False, router_sync=False),
}
