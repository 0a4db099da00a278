"""The optimizer and its schedule: AdamW, linear warmup, cosine decay to a floor."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import MAX_STEPS, Check, Section, int_in, number_in, setting


@dataclass(frozen=True)
class OptimConfig(Section):
    """AdamW with a linear warmup over `warmup` steps, then a cosine decay to min_lr_ratio x lr at
    the last step."""

    SECTION = "optim"

    lr: float = setting(3e-4, "peak learning rate", number_in(0, 10, lo_open=True))
    weight_decay: float = setting(0.1, "AdamW's decoupled weight decay", number_in(0, 10))
    betas: tuple = setting(
        (0.9, 0.95),
        "AdamW's two moment decays",
        Check("two numbers in [0, 1)", lambda v: len(v) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in v)),
    )
    warmup: int = setting(5, "steps of linear warmup", int_in(0, MAX_STEPS))
    min_lr_ratio: float = setting(0.1, "the learning rate at the last step, over lr", number_in(0, 1))

    def lr_factor(self, step: int, total: int) -> float:
        """The learning rate at `step` (0-based) of `total`, over lr."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, total - self.warmup)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
