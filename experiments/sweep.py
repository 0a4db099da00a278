"""One-factor-at-a-time sweep around the ablation's defaults: where does repacking pay?

    python -m experiments.sweep                      # all four factors, 200 steps each point
    python -m experiments.sweep --factor ratio --steps 100

Factors: inter/intra bandwidth ratio (1-16), share of long documents, sliding window, cluster
size. Writes one CSV (results/sweep/sweep.csv) with a row per (factor, value, mode).
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import sys

from tqdm import tqdm

from .ablation import add_common_args, run_ablation
from .context import run_context

FACTORS = {
    "ratio": ("ratio", [1.0, 2.0, 4.0, 7.0, 10.0, 16.0]),
    "long_share": ("long_prob", [2.5e-4, 5e-4, 1e-3, 2e-3]),
    "window": ("window", [1024, 4096, 16384]),
    "cluster": ("world_size", [32, 64, 128]),
}
COLUMNS = [
    "factor",
    "value",
    "mode",
    "selected_steps",
    "mean_step_time_s",
    "time_change_pct",
    "mean_mfu",
    "mfu_change_pp",
    "captured_gain_frac",
    "mean_inter_comm_s",
    "mean_imbalance_wait_s",
    "commit",
    "device",
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--factor", choices=sorted(FACTORS), action="append", help="factor(s) to sweep (default: all)")
    ap.add_argument("--out", default="results/sweep", help="output folder (default results/sweep)")
    args = ap.parse_args(argv)
    factors = args.factor or list(FACTORS)
    ctx = run_context()
    points = [(f, v) for f in factors for v in FACTORS[f][1]]
    rows = []
    for factor, value in tqdm(points, desc="sweep", file=sys.stderr):
        a = copy.copy(args)
        setattr(a, FACTORS[factor][0], value)
        if factor == "cluster":
            a.tokens_per_step = None  # the global batch scales with the cluster
        _, summary = run_ablation(a, progress=False)
        for mode, e in summary["modes"].items():
            rows.append(
                {
                    "factor": factor,
                    "value": value,
                    "mode": mode,
                    "selected_steps": e["steps"],
                    **{k: e[k] for k in COLUMNS if k in e},
                    "commit": ctx["commit"],
                    "device": ctx["device"],
                }
            )
        if not summary["modes"]:
            rows.append(
                {"factor": factor, "value": value, "mode": "none", "selected_steps": 0, "commit": ctx["commit"], "device": ctx["device"]}
            )
        base = summary["modes"].get("baseline")
        if base:
            best = summary["modes"]["repack+solver"]
            tqdm.write(
                f"{factor}={value}: {base['steps']} steps, repack {summary['modes']['repack']['time_change_pct']:+.2f}%, "
                f"repack+solver {best['time_change_pct']:+.2f}% ({best['mfu_change_pp']:+.2f} pp MFU)",
                file=sys.stderr,
            )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sweep.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})
    print(f"wrote {path} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
