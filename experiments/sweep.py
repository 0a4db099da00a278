"""One-factor-at-a-time sweep around the ablation's defaults: where does repacking pay?

    python -m experiments.sweep                            # every factor, both baseline pricings
    python -m experiments.sweep --factor fill --seeds 5    # one factor, more seeds

Factors: the fill (global batch over cluster capacity), the inter/intra-node ratio under both
of its readings (per group, per link), the long-document rate, the sliding window, the cluster
size (the long-document rate scaled by 64 / ranks, so a step holds as many long documents as on
the default 64 ranks: a bigger cluster at the same fill packs proportionally more documents per
step). Every point runs under both baseline pricings, for every seed. Writes one CSV
(results/sweep/sweep.csv) with a row per (factor, value, pricing, reading, seed, mode).
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import sys

from tqdm import tqdm

from solver import PlanError
from solver.baseline import PRICINGS
from solver.config import RATIO_READINGS

from .ablation import add_common_args, run_ablation
from .context import run_context
from .settings import check_output_dir

DEFAULT_LONG_PROB = 5e-4
FACTORS = {
    "fill": ("fill", [0.5, 0.75, 0.9, 0.95]),
    "ratio": ("ratio", [1.0, 2.0, 4.0, 7.0, 10.0, 16.0]),
    "long_share": ("long_prob", [2.5e-4, 5e-4, 1e-3, 2e-3]),
    "window": ("window", [1024, 4096, 16384]),
    "cluster": ("world_size", [32, 64, 128]),
}
COLUMNS = [
    "factor",
    "value",
    "baseline_pricing",
    "ratio_reading",
    "seed",
    "mode",
    "selected_steps",
    "mean_step_time_s",
    "time_change_pct",
    "mean_mfu",
    "mfu_change_pp",
    "mfu_noncausal_change_pp",
    "captured_gain_frac",
    "mean_inter_comm_s",
    "mean_imbalance_wait_s",
    "commit",
    "device",
]


def points(factors):
    """(factor, value, pricing, reading): the ratio under both readings, every factor under both pricings."""
    for factor in factors:
        for value in FACTORS[factor][1]:
            for pricing in PRICINGS:
                for reading in RATIO_READINGS if factor == "ratio" else (None,):
                    yield factor, value, pricing, reading


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--factor", choices=sorted(FACTORS), action="append", help="factor(s) to sweep (default: all)")
    ap.add_argument("--out", default="results/sweep", help="output folder (default results/sweep)")
    args = ap.parse_args(argv)
    if args.seeds is None:
        args.seeds = 3
    if args.steps is None:
        args.steps = 100
    try:
        check_output_dir(args.out)
    except PlanError as e:
        sys.exit(f"error: {e}")
    ctx = run_context()
    todo = list(points(args.factor or list(FACTORS)))
    rows = []
    for factor, value, pricing, reading in tqdm(todo, desc="sweep", file=sys.stderr):
        a = copy.copy(args)
        setattr(a, FACTORS[factor][0], value)
        a.baseline_pricing = pricing
        if reading is not None:
            a.ratio_reading = reading
        if factor == "cluster":  # as many long documents per step as on 64 ranks
            a.long_prob = (args.long_prob or DEFAULT_LONG_PROB) * 64 / value
        try:
            _, summary = run_ablation(a, progress=False)
        except PlanError as e:
            sys.exit(f"error at {factor}={value}: {e}")
        used_reading = summary["config"]["hardware"]["ratio_reading"]
        for seed, modes in summary["seeds"].items():
            for mode, e in modes.items():
                rows.append(
                    {
                        "factor": factor,
                        "value": value,
                        "baseline_pricing": pricing,
                        "ratio_reading": used_reading,
                        "seed": seed,
                        "mode": mode,
                        "selected_steps": e["steps"],
                        **{k: e.get(k) for k in COLUMNS if k in e},
                        "commit": ctx["commit"],
                        "device": ctx["device"],
                    }
                )
        over = summary["over_seeds"]
        if over:
            r, s = over["repack"]["time_change_pct"], over["repack+solver"]["time_change_pct"]
            tqdm.write(
                f"{factor}={value} {pricing} {used_reading}: repack {r['mean']:+.2f}% [{r['min']:+.2f}, {r['max']:+.2f}], "
                f"repack+solver {s['mean']:+.2f}% [{s['min']:+.2f}, {s['max']:+.2f}]",
                file=sys.stderr,
            )
    path = os.path.join(args.out, "sweep.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})
    print(f"wrote {path} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
