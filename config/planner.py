"""The planner section: the modes a step is planned in, and what the baseline balances."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Section, setting

# the paper's three modes, then the attribution control (the parent solver without repacking),
# then the width-choosing parent solver (beyond the paper: parents change width and share)
MODES = ("baseline", "repack", "repack+solver", "baseline+solver", "repack+widths")
PAPER_MODES = MODES[:3]
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
