"""Document length distributions read from files: a user's file of lengths (one a line, plain or
gzipped) or a distribution shipped with the project (experiments/common/data/, each with its
source and licence), stored as a histogram of (length, count) so the draws are the file's own.

A workload with `lengths` set (config.WorkloadConfig) draws its documents i.i.d. from one of these,
seeded, and streams them whole into steps as the generator does (experiments.common.workload).
"""

from __future__ import annotations

import gzip
import os
from functools import cache

import numpy as np

from config.cluster import MAX_TOKENS_PER_RANK, MAX_TOKENS_PER_STEP, MAX_WORLD_SIZE

from .errors import InputError

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
# name -> (file under DATA, where it comes from); data/README.md says the same, with the licence
SHIPPED = {
    "flexsp-wikipedia": (
        "flexsp-wikipedia.npz",
        "FlexSP's Wikipedia workload: 1,000,000 document lengths (Hetu-Galvatron, branch flexsp, "
        "galvatron/datasets/wikipedia.txt, Apache-2.0)",
    ),
}


def read_lengths(path: str) -> np.ndarray:
    """The lengths of a file of one integer >= 1 a line (blank lines skipped; .gz read as gzip).
    A line that is not such an integer, or one past the longest document any supported cluster
    holds, is an InputError naming the file, the line's number and its text."""
    if os.path.isdir(path):
        raise InputError(
            f"lengths file {path!r} is a folder: give a file of lengths, one a line (.txt, .txt.gz), or a shipped name: {sorted(SHIPPED)}"
        )
    if not os.path.isfile(path):
        raise InputError(f"lengths file {path!r} does not exist (give a file of lengths, one a line, or a shipped name: {sorted(SHIPPED)})")
    opener = gzip.open if path.endswith(".gz") else open
    out = []
    try:
        with opener(path, "rt") as f:
            for number, line in enumerate(f, 1):
                text = line.strip()
                if not text:
                    continue
                if not text.isdigit() or int(text) < 1:
                    raise InputError(f"lengths file {path!r} line {number}: {text[:40]!r} is not a length (an integer >= 1, one a line)")
                if int(text) > MAX_TOKENS_PER_STEP:
                    raise InputError(
                        f"lengths file {path!r} line {number}: {text[:40]} is longer than any supported cluster holds "
                        f"({MAX_TOKENS_PER_STEP:,} tokens: {MAX_WORLD_SIZE:,} ranks of {MAX_TOKENS_PER_RANK:,})"
                    )
                out.append(int(text))
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise InputError(f"lengths file {path!r} cannot be read: {e}") from None
    if not out:
        raise InputError(f"lengths file {path!r} holds no length")
    return np.asarray(out, dtype=np.int64)


def save_distribution(lengths: np.ndarray, path: str) -> None:
    """The lengths as a compressed histogram: the sorted distinct lengths and how often each occurs
    (the draws only need the distribution, and a sorted histogram compresses ~20x better)."""
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    np.savez_compressed(path, values=values.astype(np.uint32), counts=counts.astype(np.uint32))


@cache
def distribution(source: str) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct lengths, their cumulative counts) of a shipped distribution's name or of a
    lengths file: what `draw` samples from."""
    if source in SHIPPED:
        with np.load(os.path.join(DATA, SHIPPED[source][0])) as z:
            values, counts = z["values"].astype(np.int64), z["counts"].astype(np.int64)
    else:
        values, counts = np.unique(read_lengths(source), return_counts=True)
    return values, np.cumsum(counts)


def draw(source: str, rng: np.random.Generator, n: int) -> np.ndarray:
    """n lengths drawn i.i.d. (with replacement) from the source's documents, each equally likely."""
    values, cumulative = distribution(source)
    picks = rng.integers(0, int(cumulative[-1]), n)
    return values[np.searchsorted(cumulative, picks, side="right")]


def describe(source: str) -> str:
    """One line: where the lengths come from."""
    return SHIPPED[source][1] if source in SHIPPED else f"the lengths of {source}"
