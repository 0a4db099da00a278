"""Seeded variable-length workloads and real length traces (the settings: config.WorkloadConfig).

Synthetic steps: documents are drawn i.i.d. from a two-part mixture and streamed into steps of
about `tokens_per_step` tokens; a document that would overflow a step opens the next one (never
cut). The body is log-normal (web/code documents: median ~2K tokens, heavy right tail, clipped
at 32K); with a small probability a document is a long one, log-uniform in [48K, 256K] (books,
repositories, long-context upsampling). The default long-document rate is chosen so that about
10% of steps contain a document long enough to need an SP16/32 parent on the default cluster, as
in the paper (22 of 200 steps); the share is a knob of the sweep.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterator

import numpy as np

from config import SettingError, WorkloadConfig
from config.base import INT64

from . import lengths as length_files
from .errors import InputError

DRAWS = 65536  # documents drawn at once from a length distribution (the same draws whatever the batch)


def iter_steps(cfg: WorkloadConfig) -> Iterator[list[int]]:
    """The workload's steps one at a time, `cfg.steps` of them: a run of many steps never holds
    them all. The batch must be in tokens (WorkloadConfig.for_cluster)."""
    if cfg.tokens_per_step is None:
        raise ValueError("the workload's batch is a fill: resolve it for a cluster first (WorkloadConfig.for_cluster)")
    rng = np.random.default_rng(cfg.seed)
    made = 0
    cur: list[int] = []
    total = 0
    for n in _documents(cfg, rng):
        if made >= cfg.steps:
            return
        if cur and total + n > cfg.tokens_per_step:
            yield cur
            made += 1
            cur, total = [], 0
        cur.append(n)
        total += n


def _documents(cfg: WorkloadConfig, rng: np.random.Generator) -> Iterator[int]:
    """The workload's documents' lengths, endlessly: the mixture's draws, or a length
    distribution's (clipped at long_max only under clip_to_cluster, where WorkloadConfig.clipped
    set it to the widest group's tokens)."""
    if cfg.lengths is None:
        while True:
            if rng.random() < cfg.long_prob:
                yield int(np.exp(rng.uniform(np.log(cfg.long_min), np.log(cfg.long_max))))
            else:
                yield int(np.clip(rng.lognormal(np.log(cfg.body_median), cfg.body_sigma), cfg.body_min, cfg.body_max))
    clip = cfg.long_max if cfg.clip_to_cluster else None
    while True:
        block = length_files.draw(cfg.lengths, rng, DRAWS)
        yield from (block if clip is None else np.minimum(block, clip)).tolist()


def generate_steps(cfg: WorkloadConfig) -> list[list[int]]:
    """`cfg.steps` lists of document lengths (iter_steps, all at once; check_generation first)."""
    check_generation(cfg)
    return list(iter_steps(cfg))


# The generator draws about 90,000 documents a second on the 2-core development machine: this many
# take minutes. A workload that asks for more (a batch of 1e14 tokens, a world of 2^30 ranks) is
# refused before generating, instead of running for hours with nothing printed.
MAX_DOCUMENTS = 20_000_000


def mean_document(cfg: WorkloadConfig) -> float:
    """The generator's mean document length, from a fixed sample of 200,000 of its draws (vectorized:
    milliseconds; the same figure every call)."""
    rng = np.random.default_rng(0)
    n = 200_000
    if cfg.lengths is not None:
        values, cumulative = length_files.distribution(cfg.lengths)
        counts = np.diff(cumulative, prepend=0)
        clipped = np.minimum(values, cfg.long_max) if cfg.clip_to_cluster else values
        return float((clipped * counts).sum() / cumulative[-1])
    long = rng.random(n) < cfg.long_prob
    body = np.clip(rng.lognormal(np.log(cfg.body_median), cfg.body_sigma, n), cfg.body_min, cfg.body_max).astype(np.int64)
    far = np.exp(rng.uniform(np.log(cfg.long_min), np.log(cfg.long_max), n)).astype(np.int64)
    return float(np.where(long, far, body).mean())


def check_generation(cfg: WorkloadConfig, seeds: int = 1) -> None:
    """SettingError, before any document is drawn, when `seeds` runs of the workload's steps would
    draw more than MAX_DOCUMENTS documents (the batch over the mean document, per step)."""
    if cfg.tokens_per_step is None:
        raise ValueError("the workload's batch is a fill: resolve it for a cluster first (WorkloadConfig.for_cluster)")
    mean = mean_document(cfg)
    total = cfg.steps * seeds * cfg.tokens_per_step / mean
    if total > MAX_DOCUMENTS:
        raise SettingError(
            f"the workload would draw about {total:.3g} documents ({cfg.steps} steps x {seeds} seed(s) x a batch of "
            f"{cfg.tokens_per_step:,} tokens over a mean document of {mean:,.0f}), more than the {MAX_DOCUMENTS:,} the generator "
            f"draws in minutes: give fewer --steps or --seeds, or a smaller batch (--tokens-per-step, --fill, --world-size, "
            f"--tokens-per-rank)"
        )


def random_tokens(lengths, vocab: int, seed: int, step: int) -> dict[int, np.ndarray]:
    """Tokens of a step as a pure function of (seed, step): resuming needs no generator state."""
    rng = np.random.default_rng([seed, step])
    return {i: rng.integers(0, vocab, n).astype(np.int64) for i, n in enumerate(lengths)}


def longest_step(cfg: WorkloadConfig) -> tuple[int, int]:
    """(the longest document, the most tokens of a step) the generator can make, from its settings
    alone: a step holds at most tokens_per_step unless one document is longer, alone."""
    if cfg.lengths is not None:
        longest = int(length_files.distribution(cfg.lengths)[0][-1])
        longest = min(longest, cfg.long_max) if cfg.clip_to_cluster else longest
    else:
        longest = max(cfg.body_max, cfg.long_max) if cfg.long_prob > 0 else cfg.body_max
    return longest, max(cfg.tokens_per_step, longest)


def load_trace(path: str) -> list[tuple[int, list[int]]]:
    """(step number, lengths) of every step of a trace, in ascending step order, the trace's own
    step numbers kept. Formats: CSV (`step,length` rows, header optional), JSONL (one object per
    sample with `step` and `length`, or one list of lengths per line: the line is the step), or
    .npy (a [n, 2] integer array of step, length). Lengths are integers >= 1: a fraction, nan or
    inf is an error naming the line, never a silent truncation."""
    if not os.path.exists(path):
        raise InputError(f"trace file {path!r} does not exist")
    rows: list[tuple[int, int]] = []
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as e:
            raise InputError(f"trace {path!r} is not a readable .npy array of numbers ({e})") from None
        if arr.ndim != 2 or arr.shape[1] != 2:
            raise InputError(f"trace {path!r}: expected a [n, 2] array of (step, length), got shape {arr.shape}")
        if arr.dtype.kind not in "iuf":
            raise InputError(f"trace {path!r}: expected numbers, got dtype {arr.dtype}")
        rows = [(_int(a, path, i), _int(b, path, i)) for i, (a, b) in enumerate(arr.tolist(), 1)]
    elif ext in (".jsonl", ".json"):
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"trace {path!r} line {i}: not JSON ({e})") from None
                if isinstance(obj, list):
                    rows += [(i - 1, _int(v, path, i)) for v in obj]
                elif isinstance(obj, dict) and "step" in obj and "length" in obj:
                    rows.append((_int(obj["step"], path, i), _int(obj["length"], path, i)))
                else:
                    raise InputError(f"trace {path!r} line {i}: expected {{'step': int, 'length': int}} or a list of lengths")
    elif ext == ".csv":
        with open(path, newline="") as f:
            for i, rec in enumerate(csv.reader(f), 1):
                if not rec or (i == 1 and rec[0].strip().lower() == "step"):
                    continue
                if len(rec) != 2:
                    raise InputError(f"trace {path!r} line {i}: expected 2 columns step,length, got {len(rec)}")
                rows.append((_int(rec[0], path, i), _int(rec[1], path, i)))
    else:
        raise InputError(f"trace {path!r}: unknown extension {ext!r}; use .csv, .jsonl or .npy")
    if not rows:
        raise InputError(f"trace {path!r} holds no samples")
    by_step: dict[int, list[int]] = {}
    for step, n in rows:
        if n < 1:
            raise InputError(f"trace {path!r}: step {step} has a sample of length {n}; lengths must be >= 1")
        if step < 0:
            raise InputError(f"trace {path!r}: step {step} is negative")
        by_step.setdefault(step, []).append(n)
    return [(s, by_step[s]) for s in sorted(by_step)]


def _int(v, path, line) -> int:
    """v as an integer, or a InputError naming the trace and the line: strings and numbers alike,
    no truncation; an integer string is read exactly (not through a float, which would show
    99999999999999999999 as another number); beyond int64 is an error, as numpy holds lengths."""
    if isinstance(v, bool):
        raise InputError(f"trace {path!r} line {line}: {v!r} is not an integer")
    if isinstance(v, str) and v.strip().lstrip("+-").isdigit():
        v = int(v.strip())
    if not isinstance(v, int):
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise InputError(f"trace {path!r} line {line}: {v!r} is not an integer") from None
        if not math.isfinite(f) or f != int(f):
            raise InputError(f"trace {path!r} line {line}: {v!r} is not an integer")
        v = int(f)
    if not -INT64 < v < INT64:
        raise InputError(f"trace {path!r} line {line}: {v} is beyond a 64-bit integer (|value| < 2^63), the widest numpy holds")
    return v


def workload_steps(cfg: WorkloadConfig) -> list[tuple[int, list[int]]]:
    """(step number, lengths) of the workload's first `steps` steps: the trace's, with its own
    step numbers, or the generator's."""
    if cfg.trace:
        return load_trace(cfg.trace)[: cfg.steps]
    return list(enumerate(generate_steps(cfg)))
