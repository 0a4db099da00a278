"""The planner section: what the parent assignment balances (the modes: solver.modes)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Section, setting

PRICINGS = ("compute", "comm")


@dataclass(frozen=True)
class PlannerConfig(Section):
    SECTION = "planner"

    assignment_pricing: str = setting(
        "compute",
        "what the parent assignment balances: compute (attention and token-wise work, as the design's does) "
        "or comm (also each group's all-to-alls, FlexSP-like)",
        choices=PRICINGS,
    )
