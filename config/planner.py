"""The planner section: what the baseline parent assignment balances (the modes: solver.modes)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Section, setting

PRICINGS = ("compute", "comm")


@dataclass(frozen=True)
class PlannerConfig(Section):
    SECTION = "planner"

    baseline_pricing: str = setting(
        "compute",
        "what the baseline parent assignment balances: compute (attention and token-wise work, the design's baseline) "
        "or comm (also each group's all-to-alls, FlexSP-like)",
        choices=PRICINGS,
    )
