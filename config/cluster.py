"""The cluster section: ranks, nodes and each rank's token budget."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Section, SettingError, int_in, power_of_two, setting

# 16M tokens on one rank: far past any accelerator's memory for a transformer's activations; a
# larger budget is a typo, and planning or generating a step of it would not end in useful time
MAX_TOKENS_PER_RANK = 1 << 24
# 131,072 ranks: past the largest accelerator clusters built (about 100,000 GPUs); a rack-scale
# NVLink domain (576 GPUs announced) is the widest node, under 1,024
MAX_WORLD_SIZE = 1 << 17
MAX_GPUS_PER_NODE = 1 << 10
MAX_TOKENS_PER_STEP = MAX_WORLD_SIZE * MAX_TOKENS_PER_RANK  # the most a step (or a document) can hold on any cluster


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

    world_size: int = setting(64, "ranks in the job", int_in(1, MAX_WORLD_SIZE), source="an 8-node H100/H200 job")
    gpus_per_node: int = setting(
        8,
        "ranks per node: node-local children are aligned power-of-two rank ranges inside one",
        power_of_two(MAX_GPUS_PER_NODE),
        source="8 GPUs a node",
    )
    tokens_per_rank: int = setting(
        32768, "per-rank token budget: the most tokens a rank holds in any layout", int_in(1, MAX_TOKENS_PER_RANK),
        source="32K-token activations per GPU with full recompute",
    )  # fmt: skip

    def check(self) -> None:
        if self.world_size % self.gpus_per_node:
            raise SettingError(
                f"{self.spelt('world_size')}={self.world_size} is not a multiple of {self.spelt('gpus_per_node')}="
                f"{self.gpus_per_node}; valid world sizes are k * {self.gpus_per_node}"
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
