"""The cluster section: ranks, nodes and each rank's token budget."""

from __future__ import annotations

from dataclasses import dataclass

from .base import POSITIVE_INT, POWER_OF_TWO, Section, SettingError, setting


def ceil_pow2(x: float) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    p = 1
    while p < x:
        p *= 2
    return p


@dataclass(frozen=True)
class Cluster(Section):
    """`world_size` ranks in nodes of `gpus_per_node`; each rank holds at most `tokens_per_rank`
    tokens of a step in any layout."""

    SECTION = "cluster"

    world_size: int = setting(64, "ranks in the job", POSITIVE_INT, source="an 8-node H100/H200 job")
    gpus_per_node: int = setting(
        8, "ranks per node: node-local children are aligned power-of-two rank ranges inside one", POWER_OF_TWO, source="8 GPUs a node"
    )
    tokens_per_rank: int = setting(
        32768, "per-rank token budget: the most tokens a rank holds in any layout", POSITIVE_INT,
        source="32K-token activations per GPU with full recompute",
    )  # fmt: skip

    def check(self) -> None:
        if self.world_size % self.gpus_per_node:
            raise SettingError(
                f"cluster.world_size={self.world_size} is not a multiple of cluster.gpus_per_node={self.gpus_per_node}; "
                f"valid world sizes are k * {self.gpus_per_node}"
            )

    @property
    def widest_group(self) -> int:
        """The widest aligned group: the largest power of two <= world_size."""
        widest = 1
        while widest * 2 <= self.world_size:
            widest *= 2
        return widest

    def min_group_size(self, length: int) -> int:
        """Memory floor: a sample of `length` tokens needs 2**ceil(log2(L / tokens_per_rank)) ranks."""
        return ceil_pow2(length / self.tokens_per_rank)

    def max_sample_length(self) -> int:
        """Longest sample a group can hold: the widest aligned group's tokens."""
        return self.widest_group * self.tokens_per_rank
