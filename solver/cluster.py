"""Samples, the checks of a step's samples, and the error every planner raises (the cluster is
config.Cluster)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from config import Cluster, ceil_pow2

__all__ = ["Cluster", "PlanError", "Sample", "ceil_div", "ceil_pow2", "ceil_pow2_array", "check_samples", "is_pow2", "samples_from_lengths"]


class PlanError(ValueError):
    """A step that cannot be planned (a sample that cannot be placed), or a layout given by hand that
    is invalid: the user's input. The message names the sample, group or rank; entry points print
    it as one line. Bad settings are config.SettingError."""


class InternalError(RuntimeError):
    """A broken invariant: a bug, never bad input. Entry points keep its traceback (it is not one of
    their one-line user errors) and say it is a bug."""


class PlanInvariantError(InternalError):
    """A plan a solver built fails StepPlan.validate: the solver broke an invariant (every sample
    placed once, budgets held, children inside their parents)."""


def is_pow2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def ceil_pow2_array(x) -> np.ndarray:
    """ceil_pow2 elementwise (int64), exact at powers of two whatever log2 rounds to."""
    x = np.asarray(x, dtype=np.float64)
    p = np.exp2(np.ceil(np.log2(np.maximum(x, 1.0))))
    p = np.where(p < x, 2 * p, p)
    p = np.where((p > 1) & (p / 2 >= x), p / 2, p)
    return p.astype(np.int64)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(values, return_inverse=True) of non-negative integers: its sorted distinct values
    and each value's index among them. Where the values are small (group sizes, keys made of a
    few of them) by a table over 0..max, about ten times faster than np.unique's sort on the
    thousands of parents of a large step, which hold a handful of sizes."""
    values = np.asarray(values)
    if values.dtype.kind in "iu" and len(values) and int(values.min()) >= 0 and int(values.max()) < DENSE_DISTINCT:
        present = np.bincount(values) > 0
        return np.flatnonzero(present), (np.cumsum(present) - 1)[values]
    return np.unique(values, return_inverse=True)


DENSE_DISTINCT = 1 << 20  # distinct() tables values below this


@dataclass(frozen=True)
class Sample:
    id: int
    length: int


# the last step check_samples passed, and its cluster: the planner's stages each check the step
# they are handed, and all of them are handed the same tuple (a tuple of frozen Samples cannot
# change; holding it keeps its id from being reused)
_last_checked: list = [None, None]


class StepMemo:
    """One answer kept for the step check_samples passed last (it cannot change, as above), under
    a key of the other arguments: a stage that runs more than once on one step (the assignment's
    anchors, the joint fill, which several modes start from) computes its answer once. Any other
    step, or another key, is a miss; an answer for a new step replaces the one kept."""

    MISS = object()

    def __init__(self):
        self._samples, self._key, self._value = None, None, None

    def get(self, samples, key: tuple):
        if samples is _last_checked[0] and samples is self._samples and key == self._key:
            return self._value
        return StepMemo.MISS

    def put(self, samples, key: tuple, value) -> None:
        if samples is _last_checked[0]:
            self._samples, self._key, self._value = samples, key, value


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
