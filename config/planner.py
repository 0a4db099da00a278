"""The planner section: the modes a step is planned in, and what the baseline balances."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Section, setting

# the paper's three modes, then the attribution control (the parent solver without repacking),
# then the width-choosing parent solver (beyond the paper: parents change width and share); then
# the other ways the field runs the sparse layers: the redistribution pass the paper avoids (its
# parents and children, the layout changed by an all-to-all of its own at every full/sparse
# boundary), halo children, the parent's own layout with halo attention, and the per-parent
# choice of the cheapest (solver.halo)
MODES = ("baseline", "repack", "repack+solver", "baseline+solver", "repack+widths", "redistribute", "halo", "parent+halo", "choose")
PAPER_MODES = MODES[:3]
HALO_MODES = ("halo", "parent+halo", "choose")  # the modes a sparse kind without a reach cannot run (choose falls back)
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
