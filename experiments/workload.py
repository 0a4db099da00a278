"""Seeded variable-length workloads and real length traces.

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
from dataclasses import asdict, dataclass, fields

import numpy as np

from solver import PlanError
from solver.cluster import check_non_negative, check_positive_int

# Per-rank token budget of the default cluster: 32K-token activations per GPU with recompute.
DEFAULT_TOKENS_PER_RANK = 32768
# A default step's global batch, per rank of the cluster: half of the default budget.
DEFAULT_STEP_TOKENS_PER_RANK = 16384


def default_tokens_per_step(world_size: int) -> int:
    """The global batch of a default step on `world_size` ranks (the ablation's, the driver's and
    the planning benchmark's)."""
    return DEFAULT_STEP_TOKENS_PER_RANK * world_size


@dataclass(frozen=True)
class WorkloadConfig:
    steps: int = 200
    tokens_per_step: int = 1 << 20  # global batch: 1M tokens = default_tokens_per_step(64)
    body_median: int = 2048
    body_sigma: float = 1.2
    body_min: int = 16
    body_max: int = 32768
    long_prob: float = 5e-4  # per document
    long_min: int = 49152
    long_max: int = 262144
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "tokens_per_step", "body_median", "body_min", "body_max", "long_min", "long_max"):
            check_positive_int(f"workload.{name}", getattr(self, name))
        v = self.seed
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise PlanError(f"workload.seed={v!r} is invalid: use an integer >= 0")
        for name in ("body_sigma", "long_prob"):
            check_non_negative(f"workload.{name}", getattr(self, name))
        if self.long_prob > 1:
            raise PlanError(f"workload.long_prob={self.long_prob!r} is a probability: use a number in [0, 1]")
        if self.body_min > self.body_max or self.long_min > self.long_max:
            raise PlanError(
                f"workload bounds are crossed: body [{self.body_min}, {self.body_max}], long [{self.long_min}, {self.long_max}]"
            )

    def to_dict(self):
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> WorkloadConfig:
        """A workload from a dict (a config file's section); an unknown key is an error naming it."""
        known = {f.name for f in fields(WorkloadConfig)}
        bad = sorted(set(d) - known)
        if bad:
            raise PlanError(f"unknown workload setting {bad[0]!r}; valid: {sorted(known)}")
        return WorkloadConfig(**d)


def generate_steps(cfg: WorkloadConfig) -> list[list[int]]:
    """`cfg.steps` lists of document lengths."""
    rng = np.random.default_rng(cfg.seed)
    steps: list[list[int]] = []
    cur: list[int] = []
    total = 0
    while len(steps) < cfg.steps:
        if rng.random() < cfg.long_prob:
            n = int(np.exp(rng.uniform(np.log(cfg.long_min), np.log(cfg.long_max))))
        else:
            n = int(np.clip(rng.lognormal(np.log(cfg.body_median), cfg.body_sigma), cfg.body_min, cfg.body_max))
        if cur and total + n > cfg.tokens_per_step:
            steps.append(cur)
            cur, total = [], 0
        cur.append(n)
        total += n
    return steps


def load_trace(path: str) -> list[tuple[int, list[int]]]:
    """(step number, lengths) of every step of a trace, in ascending step order, the trace's own
    step numbers kept. Formats: CSV (`step,length` rows, header optional), JSONL (one object per
    sample with `step` and `length`, or one list of lengths per line: the line is the step), or
    .npy (a [n, 2] integer array of step, length). Lengths are integers >= 1: a fraction, nan or
    inf is an error naming the line, never a silent truncation."""
    if not os.path.exists(path):
        raise PlanError(f"trace file {path!r} does not exist")
    rows: list[tuple[int, int]] = []
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as e:
            raise PlanError(f"trace {path!r} is not a readable .npy array of numbers ({e})") from None
        if arr.ndim != 2 or arr.shape[1] != 2:
            raise PlanError(f"trace {path!r}: expected a [n, 2] array of (step, length), got shape {arr.shape}")
        if arr.dtype.kind not in "iuf":
            raise PlanError(f"trace {path!r}: expected numbers, got dtype {arr.dtype}")
        rows = [(_int(a, path, i), _int(b, path, i)) for i, (a, b) in enumerate(arr.tolist(), 1)]
    elif ext in (".jsonl", ".json"):
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise PlanError(f"trace {path!r} line {i}: not JSON ({e})") from None
                if isinstance(obj, list):
                    rows += [(i - 1, _int(v, path, i)) for v in obj]
                elif isinstance(obj, dict) and "step" in obj and "length" in obj:
                    rows.append((_int(obj["step"], path, i), _int(obj["length"], path, i)))
                else:
                    raise PlanError(f"trace {path!r} line {i}: expected {{'step': int, 'length': int}} or a list of lengths")
    elif ext == ".csv":
        with open(path, newline="") as f:
            for i, rec in enumerate(csv.reader(f), 1):
                if not rec or (i == 1 and rec[0].strip().lower() == "step"):
                    continue
                if len(rec) != 2:
                    raise PlanError(f"trace {path!r} line {i}: expected 2 columns step,length, got {len(rec)}")
                rows.append((_int(rec[0], path, i), _int(rec[1], path, i)))
    else:
        raise PlanError(f"trace {path!r}: unknown extension {ext!r}; use .csv, .jsonl or .npy")
    if not rows:
        raise PlanError(f"trace {path!r} holds no samples")
    by_step: dict[int, list[int]] = {}
    for step, n in rows:
        if n < 1:
            raise PlanError(f"trace {path!r}: step {step} has a sample of length {n}; lengths must be >= 1")
        if step < 0:
            raise PlanError(f"trace {path!r}: step {step} is negative")
        by_step.setdefault(step, []).append(n)
    return [(s, by_step[s]) for s in sorted(by_step)]


def _int(v, path, line) -> int:
    """v as an integer, or a PlanError naming the line: strings and numbers alike, no truncation."""
    if isinstance(v, bool):
        raise PlanError(f"trace {path!r} line {line}: {v!r} is not an integer")
    if isinstance(v, int):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise PlanError(f"trace {path!r} line {line}: {v!r} is not an integer") from None
    if not math.isfinite(f) or f != int(f):
        raise PlanError(f"trace {path!r} line {line}: {v!r} is not an integer")
    return int(f)
