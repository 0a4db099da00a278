"""The results schema shared by the simulator (experiments.ablation) and the training driver
(experiments.train), and read by the notebooks and experiments.report.

A run folder holds:
  steps.csv     one row per (seed, step, mode): STEP_COLUMN_TYPES
  summary.json  {"provenance": {...commit, device, time}, "config": {every setting that moves a
                 figure}, "modes": {mode: means over every selected step of every seed},
                 "seeds": {seed: {mode: means}}, "over_seeds": {mode: {figure: mean, min, max}},
                 "paper": PAPER, "engine": "sim" | "torch"}
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os

import numpy as np

from solver.modes import MODES, PAPER_MODES, REFERENCE, paper_figures

from .errors import InputError
from .files import sha256_of

# Every column and its type: the reader parses by this table, never by guessing (a diverging
# run's nan or inf loss stays a float and shows as such).
STEP_COLUMN_TYPES = {
    "engine": str,
    "mode": str,
    "seed": int,
    "step": int,
    "n_samples": int,
    "tokens": int,
    "longest": int,
    "widest_parent": int,
    "wide_parents": int,
    "repacked_parents": int,
    "halo_parents": int,  # parents some of whose sparse attention runs by halo exchange
    "halo_across_parents": int,  # of which some halo child spans nodes
    "anchor_load_ratio": float,  # max over wide parents: its anchor child's tokens per rank / the step's mean
    "step_time_s": float,
    "mfu": float,  # causal full attention FLOPs (ours)
    "mfu_noncausal": float,  # the older convention: full attention counts all L^2 pairs
    "lower_bound_s": float,
    "compute_s": float,
    "intra_comm_s": float,
    "inter_comm_s": float,
    "moe_comm_s": float,
    "grad_sync_s": float,
    "optimizer_s": float,
    "imbalance_wait_s": float,
    "full_intra_bytes": float,
    "full_inter_bytes": float,
    "sparse_intra_bytes": float,
    "sparse_inter_bytes": float,
    "moe_intra_bytes": float,  # the experts' dispatch and combine all-to-alls (the simulator: their expectation)
    "moe_inter_bytes": float,
    "model_flops": float,
    # measured by the driver with --timers (mean over ranks; the device synchronized around each)
    "host_s": float,  # the plan's checks, the rank's context and its local batch
    "forward_s": float,  # forward pass, exchanges and FSDP2's gathers included
    "backward_s": float,  # backward pass (recompute and FSDP2's reductions included)
    # the full site's exchanges (pack + all-to-all + unpack), both passes; the simulator fills
    # this and the next with its all-to-alls' time from a rank's arrival to their end (waits included)
    "exchange_full_s": float,
    "exchange_sparse_s": float,  # sparse sites' exchanges, both passes
    "exchange_moe_s": float,  # the experts' all-to-all calls, every pass
    "exchange_a2a_s": float,  # the all-to-all calls alone, every site
    "plan_hash": str,
    "plan_ms": float,
    "loss": float,
}
STEP_COLUMNS = list(STEP_COLUMN_TYPES)
ROW_BYTES = 1024  # a steps.csv row is under this (about 600 bytes: 52 numbers written in full)
BREAKDOWN = ("compute_s", "intra_comm_s", "inter_comm_s", "moe_comm_s", "grad_sync_s", "optimizer_s", "imbalance_wait_s")

# The paper's ablation (docs/design.md): change of mean step time vs baseline and MFU change.
# Its figures per mode are the mode table's (solver.modes); the summary carries them as before.
PAPER = {m: paper_figures(m) for m in PAPER_MODES} | {
    "derived_baseline_mfu_pct": 59.0,  # 3.75 / 0.0633 = 59.3; 4.83 / 0.0824 = 58.6
}


def _mean(rows, key):
    """Mean of a column, or None when any row lacks it (the training driver has no lower bound)."""
    vals = [r.get(key) for r in rows]
    if not vals or any(v in ("", None) for v in vals):
        return None
    return float(np.mean(vals))


def mode_order(modes) -> list[str]:
    return sorted(modes, key=lambda m: MODES.index(m) if m in MODES else len(MODES))


def summarize(rows: list[dict]) -> dict:
    """Per-mode means and changes vs baseline over the given rows (the same steps in every mode)."""
    out = {}
    for m in mode_order({r["mode"] for r in rows}):
        rs = [r for r in rows if r["mode"] == m]
        entry = {
            "steps": len(rs),
            "mean_step_time_s": float(np.mean([r["step_time_s"] for r in rs])),
            "mean_mfu": float(np.mean([r["mfu"] for r in rs])),
            "mean_mfu_noncausal": _mean(rs, "mfu_noncausal"),
            "mean_lower_bound_s": _mean(rs, "lower_bound_s"),
        }
        for k in BREAKDOWN + ("loss",):
            entry["mean_" + k] = _mean(rs, k)
        out[m] = entry
    if REFERENCE in out:
        b = out[REFERENCE]
        for e in out.values():
            e["time_change_pct"] = 100.0 * (e["mean_step_time_s"] / b["mean_step_time_s"] - 1.0)
            e["mfu_change_pp"] = 100.0 * (e["mean_mfu"] - b["mean_mfu"])
            if b["mean_mfu_noncausal"] is not None and e["mean_mfu_noncausal"] is not None:
                e["mfu_noncausal_change_pp"] = 100.0 * (e["mean_mfu_noncausal"] - b["mean_mfu_noncausal"])
            lb = b.get("mean_lower_bound_s")
            gap = b["mean_step_time_s"] - lb if lb is not None else None
            e["captured_gain_frac"] = (b["mean_step_time_s"] - e["mean_step_time_s"]) / gap if gap and gap > 0 else None
    return out


SEED_FIGURES = ("time_change_pct", "mfu_change_pp", "mfu_noncausal_change_pp", "mean_mfu", "mean_mfu_noncausal", "captured_gain_frac")


def summarize_seeds(rows: list[dict]) -> tuple[dict, dict]:
    """(per seed: summarize of its rows; per mode: each figure's mean, min and max over seeds).
    One seed's mean is not a result: its range over seeds goes with it."""
    seeds = sorted({int(r.get("seed", 0)) for r in rows})
    per_seed = {s: summarize([r for r in rows if int(r.get("seed", 0)) == s]) for s in seeds}
    per_seed = {s: v for s, v in per_seed.items() if v}
    over = {}
    for m in mode_order({m for v in per_seed.values() for m in v}):
        entry = {"seeds": [s for s, v in per_seed.items() if m in v]}
        for k in SEED_FIGURES:
            vals = [v[m][k] for v in per_seed.values() if m in v and v[m].get(k) is not None]
            entry[k] = {"mean": float(np.mean(vals)), "min": float(np.min(vals)), "max": float(np.max(vals))} if vals else None
        over[m] = entry
    return {str(s): v for s, v in per_seed.items()}, over


def strict_json(obj):
    """`obj` with every non-finite float written as the string "nan", "inf" or "-inf": strict JSON
    (a bare NaN token is not JSON), and a diverged run's loss still reads as what it was."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    if isinstance(obj, np.generic):
        return strict_json(obj.item())
    return obj


def write_run(folder: str, rows: list[dict], summary: dict) -> tuple[str, str]:
    """steps.csv and summary.json (strict JSON) as one unit: both are written whole to temporary
    files first (a full disk fails there, before anything is replaced: InputError, one line), then
    renamed into place, steps.csv first; summary.json carries steps.csv's sha256, so a pair torn
    between the two renames (a crash there) is refused by read_run, never read as one run."""
    csv_path, json_path = os.path.join(folder, "steps.csv"), os.path.join(folder, "summary.json")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(csv_path + ".tmp", "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=STEP_COLUMNS)
            w.writeheader()
            for r in rows:
                w.writerow({k: r.get(k, "") for k in STEP_COLUMNS})
            f.flush()
            os.fsync(f.fileno())
        stamped = {**strict_json(summary), "steps_sha256": sha256_of(csv_path + ".tmp")}
        with open(json_path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(stamped, f, indent=2, sort_keys=True, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(csv_path + ".tmp", csv_path)
        os.replace(json_path + ".tmp", json_path)
    except OSError as e:
        for tmp in (csv_path + ".tmp", json_path + ".tmp"):
            with contextlib.suppress(OSError):
                os.remove(tmp)
        raise InputError(
            f"the results cannot be written to {folder!r} ({e.strerror or e}); what was there is unchanged: free space, or give "
            f"another --out"
        ) from None
    return csv_path, json_path


def read_run(folder: str) -> tuple[list[dict], dict]:
    """Rows (typed by STEP_COLUMN_TYPES; an empty cell is None) and the summary of a run folder,
    checked against each other: summary.json names steps.csv's sha256 (the two files of one
    write_run), and the rows of each mode are as many as the summary counted. Anything else (a
    summary that is not an object, a file that is not UTF-8, a torn or mixed pair) is an
    InputError naming the file."""
    for name in ("summary.json", "steps.csv"):
        if not os.path.isfile(os.path.join(folder, name)):
            raise InputError(f"{folder!r} has no {name}: not a run's results (or an incomplete one)")
    try:
        with open(os.path.join(folder, "summary.json"), encoding="utf-8") as f:
            summary = json.load(f)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise InputError(f"{folder}/summary.json is not JSON ({e})") from None
    if not isinstance(summary, dict):
        raise InputError(f"{folder}/summary.json holds a JSON {type(summary).__name__}; a run's summary is an object (write_run's)")
    digest = summary.get("steps_sha256")
    if digest is None:
        raise InputError(f"{folder}/summary.json names no steps.csv digest: not written by this version's write_run (rerun its command)")
    if digest != sha256_of(os.path.join(folder, "steps.csv")):
        raise InputError(
            f"{folder}/steps.csv is not the one {folder}/summary.json was written with (its sha256 differs): the two files are of "
            f"different runs, or one was cut short or replaced; rerun the command that wrote them"
        )
    try:
        rows = _read_rows(folder)
    except UnicodeDecodeError as e:
        raise InputError(f"{folder}/steps.csv is not UTF-8 text (byte {e.start}: {e.reason}): not a run's steps, or damaged") from None
    for mode, entry in (summary.get("modes") or {}).items():
        have = sum(r["mode"] == mode for r in rows)
        if isinstance(entry, dict) and entry.get("steps") != have:
            raise InputError(
                f"{folder}/steps.csv has {have} rows of mode {mode} but summary.json counted {entry.get('steps')}: "
                f"the two files disagree (one was cut short or replaced)"
            )
    return rows, summary


def _read_rows(folder: str) -> list[dict]:
    rows = []
    with open(os.path.join(folder, "steps.csv"), newline="", encoding="utf-8") as f:
        for i, r in enumerate(csv.DictReader(f), 2):
            if None in r or None in r.values():
                raise InputError(f"{folder}/steps.csv line {i} has {'more' if None in r else 'fewer'} cells than the header")
            for k, v in r.items():
                kind = STEP_COLUMN_TYPES.get(k)
                if kind is None:
                    raise InputError(f"{folder}/steps.csv line {i}: unknown column {k!r}; known: {STEP_COLUMNS}")
                if v == "":
                    r[k] = None
                    continue
                try:
                    r[k] = kind(v)
                except ValueError:
                    raise InputError(f"{folder}/steps.csv line {i}: column {k!r} = {v!r} is not a {kind.__name__}") from None
            rows.append(r)
    return rows


def read_ablation(folder: str) -> tuple[list[dict], dict]:
    """An ablation's rows and summary (python -m experiments.ablation's output): read_run's, checked
    to be the simulator's (not a training run's) with the modes compared on at least one selected
    step; otherwise InputError naming the folder and what would be valid. FileNotFoundError when
    the folder holds no summary (the report keeps such a block and names the command)."""
    if not os.path.exists(os.path.join(folder, "summary.json")):
        raise FileNotFoundError(folder)
    rows, summary = read_run(folder)
    engine = summary.get("engine")
    if engine != "sim":
        raise InputError(
            f"{folder!r} holds the results of engine {engine!r} (the training driver's, python -m experiments.train), not an "
            f"ablation's (engine 'sim'): write the ablation there with python -m experiments.ablation --out {folder}"
        )
    for key in ("config", "over_seeds", "modes", "selected_steps"):
        if not isinstance(summary.get(key), dict):
            raise InputError(f"{folder}/summary.json has no {key!r} object: not an ablation's summary")
    if not rows or REFERENCE not in summary["over_seeds"]:
        cfg = summary["config"]
        steps, seeds = cfg.get("workload", {}).get("steps"), cfg.get("seeds")
        raise InputError(
            f"{folder!r}: the ablation selected no step (none of its {steps} steps for seeds {seeds} has a parent wider than a "
            f"node), so no mode is compared: run more steps (--steps, 200 by default) or a workload with longer documents"
        )
    return rows, summary


def paired_steps(sim_dir: str, measured_dir: str) -> list[tuple[dict, dict]]:
    """(simulated row, measured row) of every (step, mode) both runs have, in the measured order."""
    sim_rows, _ = read_run(sim_dir)
    meas_rows, _ = read_run(measured_dir)
    sim = {(r["step"], r["mode"]): r for r in sim_rows}
    return [(sim[(r["step"], r["mode"])], r) for r in meas_rows if (r["step"], r["mode"]) in sim]


# the parts of a step both sides time alike (a rank's time from arriving at a site's exchanges to
# their end, waits included: the simulator's exchange_*_s, the driver's --timers), and the rest
GAP_PARTS = ("full", "sparse", "experts", "rest")
_EXCHANGE_COLUMNS = {"full": "exchange_full_s", "sparse": "exchange_sparse_s", "experts": "exchange_moe_s"}


def _step_parts(row: dict) -> dict[str, float]:
    """A step row's seconds by GAP_PARTS: each site's exchanges, and the rest of the step."""
    out = {p: float(row[k] or 0.0) for p, k in _EXCHANGE_COLUMNS.items()}
    out["rest"] = float(row["step_time_s"]) - sum(out.values())
    return out


def gap_by_part(pairs: list[tuple[dict, dict]]) -> dict[str, dict[str, float]]:
    """Per mode but the baseline, its gap (predicted minus measured change of step time vs the
    baseline's same step, pp, mean over steps) split by the part of the step it comes from: a
    part's share is (its predicted change / the baseline's predicted step) less (its measured
    change / the baseline's measured step), so the parts add up to the gap exactly. Where a mode
    measures less gain than predicted, this says which exchanges (or the rest of the step) took it."""
    base = {
        m["step"]: (_step_parts(s), float(s["step_time_s"]), _step_parts(m), float(m["step_time_s"]))
        for s, m in pairs
        if m["mode"] == REFERENCE
    }
    out: dict[str, dict[str, float]] = {}
    for mode in (m for m in MODES if m != REFERENCE):
        mine = [(s, m) for s, m in pairs if m["mode"] == mode and m["step"] in base]
        if not mine:
            continue
        share = {p: [] for p in GAP_PARTS}
        for s, m in mine:
            bp, bp_step, bm, bm_step = base[m["step"]]
            ps, ms = _step_parts(s), _step_parts(m)
            for p in GAP_PARTS:
                share[p].append(100 * ((ps[p] - bp[p]) / bp_step - (ms[p] - bm[p]) / bm_step))
        out[mode] = {p: float(np.mean(v)) for p, v in share.items()}
        out[mode]["gap"] = sum(out[mode][p] for p in GAP_PARTS)
    return out


def change_slope(pairs: list[tuple[dict, dict]], parts: tuple[str, ...]) -> float:
    """How much of a predicted change in these GAP_PARTS of the step the measurement shows: the
    least-squares slope of the measured change (against the baseline's same step) on the
    predicted one, over every step and mode; nan with fewer than two distinct predicted changes."""

    def seconds(row: dict) -> float:
        split = _step_parts(row)
        return sum(split[p] for p in parts)

    base = {m["step"]: (seconds(s), seconds(m)) for s, m in pairs if m["mode"] == REFERENCE}
    x, y = [], []
    for s, m in pairs:
        if m["mode"] != REFERENCE and m["step"] in base:
            x.append(seconds(s) - base[m["step"]][0])
            y.append(seconds(m) - base[m["step"]][1])
    x_arr, y_arr = np.array(x), np.array(y)
    if len(set(x)) < 2:
        return float("nan")
    xc = x_arr - x_arr.mean()
    return float(np.sum(xc * (y_arr - y_arr.mean())) / np.sum(xc * xc))


def rest_paid(pairs: list[tuple[dict, dict]]) -> float:
    """How much of a predicted change in the rest of the step (the step less its exchanges, which
    between modes on the same tokens differs by the samples, or a linear kind's blocks, each rank
    loops over and by the imbalance wait) the measured rest shows (change_slope). 1: the cluster pays both
    as priced (ranks on devices of their own); below 1: less (ranks sharing cores, where a sample
    costs a rank less while fewer ranks loop over samples, experiments.bench.contention, and a
    waiting rank's share of the cores goes to the busy ones)."""
    return change_slope(pairs, ("rest",))


def exchanges_paid(pairs: list[tuple[dict, dict]]) -> float:
    """How much of a predicted change in the step's exchanges (every site's) the measured exchanges
    show (change_slope). 1: an exchange saved saves what it was priced at; above 1: more (on shared
    cores a busy step's exchanges also wait for time-sliced peers, which the calibration's lone
    calls and near-empty steps do not)."""
    return change_slope(pairs, tuple(p for p in GAP_PARTS if p != "rest"))
