"""Cluster, samples and the errors every planner raises on bad input."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


class PlanError(ValueError):
    """Bad input to a planner, or a batch that cannot be placed. The message names the value."""


# ----- value checks every config and entry point shares: a PlanError naming the value ----------
def check_positive_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PlanError(f"{name}={v!r} is invalid: it must be an integer >= 1")


def check_positive(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise PlanError(f"{name}={v!r} is invalid: it must be a finite number > 0")


def check_non_negative(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise PlanError(f"{name}={v!r} is invalid: it must be a finite number >= 0")


def check_fraction(name: str, v) -> None:
    check_non_negative(name, v)
    if v > 1:
        raise PlanError(f"{name}={v!r} is invalid: it is a fraction in [0, 1]")


def matches_type(value, default) -> bool:
    """Is `value` of the type a setting whose default is `default` takes? (an int is a float; a
    bool is neither an int nor a float)"""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, type(default))


def is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def ceil_pow2(x: float) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    p = 1
    while p < x:
        p *= 2
    return p


def ceil_pow2_array(x) -> np.ndarray:
    """ceil_pow2 elementwise (int64), exact at powers of two whatever log2 rounds to."""
    x = np.asarray(x, dtype=np.float64)
    p = np.exp2(np.ceil(np.log2(np.maximum(x, 1.0))))
    p = np.where(p < x, 2 * p, p)
    p = np.where((p > 1) & (p / 2 >= x), p / 2, p)
    return p.astype(np.int64)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Cluster:
    """`world_size` ranks in nodes of `gpus_per_node`; each rank holds at most `tokens_per_rank`."""

    world_size: int
    gpus_per_node: int = 8
    tokens_per_rank: int = 16384

    def __post_init__(self):
        for name in ("world_size", "gpus_per_node", "tokens_per_rank"):
            check_positive_int(name, getattr(self, name))
        if not is_pow2(self.gpus_per_node):
            raise PlanError(
                f"gpus_per_node={self.gpus_per_node} is not a power of two; node-local "
                "children are aligned power-of-two rank ranges, so use 1, 2, 4, 8, ..."
            )
        if self.world_size % self.gpus_per_node:
            raise PlanError(
                f"world_size={self.world_size} is not a multiple of gpus_per_node="
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


@dataclass(frozen=True)
class Sample:
    id: int
    length: int


# the last step check_samples passed, and its cluster: the planner's stages each check the step
# they are handed, and all of them are handed the same tuple (a tuple of frozen Samples cannot
# change; holding it keeps its id from being reused)
_last_checked: list = [None, None]


def check_samples(samples: Iterable[Sample], cluster: Cluster | None = None) -> tuple[Sample, ...]:
    """Validate ids and lengths; return the samples as a tuple. Raises PlanError naming the value."""
    if samples is _last_checked[0] and cluster == _last_checked[1]:
        return samples
    out = tuple(samples)
    if not out:
        raise PlanError("the step has no samples; a step needs at least one sample")
    ids = [s.id for s in out]
    lengths = [s.length for s in out]
    longest = cluster.max_sample_length() if cluster is not None else None
    # one pass over the whole step at C speed; the sample-by-sample loop below runs only to name
    # what is wrong (type(x) is int: True for ints, False for bools and every other type)
    ok = (
        all(type(n) is int for n in lengths)
        and all(type(i) is int for i in ids)
        and min(lengths) >= 1
        and min(ids) >= 0
        and len(set(ids)) == len(ids)
        and (longest is None or max(lengths) <= longest)
    )
    if not ok:
        _name_bad_sample(out, longest, cluster)
    if cluster is not None:
        total = sum(lengths)
        cap = cluster.world_size * cluster.tokens_per_rank
        if total > cap:
            raise PlanError(
                f"the batch has {total} tokens but the cluster holds at most {cap} "
                f"({cluster.world_size} ranks x tokens_per_rank={cluster.tokens_per_rank})"
            )
    if samples is out and all(type(x) is Sample for x in out):  # a tuple of frozen Samples: it cannot change
        _last_checked[:] = [out, cluster]
    return out


def _name_bad_sample(samples: tuple[Sample, ...], longest: int | None, cluster: Cluster | None) -> None:
    """Raise PlanError naming the first bad sample of a step that failed check_samples' fast checks."""
    seen: set[int] = set()
    for s in samples:
        if type(s.length) is not int or s.length < 1:
            raise PlanError(f"sample id={s.id} has length={s.length!r}; lengths must be integers >= 1")
        if type(s.id) is not int or s.id < 0:
            raise PlanError(f"sample id={s.id!r} is invalid; ids must be integers >= 0")
        if s.id in seen:
            raise PlanError(f"duplicate sample id={s.id}; every sample id in a step must be unique")
        seen.add(s.id)
        if longest is not None and s.length > longest:
            raise PlanError(
                f"sample id={s.id} of length={s.length} cannot be placed: the widest aligned group "
                f"of this cluster (world_size={cluster.world_size}, tokens_per_rank="
                f"{cluster.tokens_per_rank}) holds at most {longest} tokens"
            )
    raise AssertionError("check_samples' fast checks failed but no sample is bad")


def samples_from_lengths(lengths: Sequence[int]) -> tuple[Sample, ...]:
    return tuple(Sample(i, int(n)) for i, n in enumerate(lengths))
