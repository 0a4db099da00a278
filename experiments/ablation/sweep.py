"""One-factor-at-a-time sweep around the ablation's defaults: where does repacking pay?

    python -m experiments.ablation.sweep                           # every factor, both assignment pricings
    python -m experiments.ablation.sweep --factors fill --seeds 5  # one factor, more seeds
    python -m experiments.ablation.sweep --model paper-gdn --factors fill,ratio,cluster,state --out results/sweep-gdn
    python -m experiments.ablation.sweep --factors overlap --out results/sweep-overlap

Factors: the fill (global batch over cluster capacity), the inter/intra-node ratio under both
of its readings (per group, per link), the long-document rate, the sliding window, the sparse kind
(a sliding window of 4096, chunks of 8192), the cluster size (the long-document rate scaled by 64 /
ranks, so a step holds as many long documents as on the default 64 ranks: a bigger cluster at the
same fill packs proportionally more documents per step); for a linear kind's model (paper-gdn),
the state's size (`state`: both head dims of its linear layers; not in the default list, which
is the windowed model's); the exchanges pipelined with attention in head blocks (`overlap`, a priced
what-if the runtime does not run; not in the default list). Every point runs every mode, the other
ways to run the sparse layers among them (redistribute, halo, parent+halo, choose), under both
assignment pricings, for every seed; with --whole-run, every other step of each point's run too,
for each mode's change over the whole run (column whole_run_change_pct, empty without it). Writes
one CSV (results/sweep/sweep.csv) with a row per (factor, value, pricing, reading, seed, mode).
"""

from __future__ import annotations

import csv
import os
import sys

from tqdm import tqdm

from config import PRICINGS, RATIO_READINGS, SettingError
from config.cli import Command, Settings
from config.entries import SWEEP_FACTORS, SweepOptions
from config.reads import unread_reason
from experiments.ablation.run import SECTIONS
from experiments.common import entry
from experiments.common.ablation import run_ablation
from experiments.common.files import check_output_dir, lock_folder
from experiments.common.provenance import provenance
from experiments.common.settings import MODEL_CHOICES, prepare
from solver.cost import sparse_cost
from solver.modes import modes_help, modes_where

COMMAND = Command(
    "experiments.ablation.sweep",
    __doc__,
    (*SECTIONS, SweepOptions),
    defaults={"workload.steps": 100},
    choices=MODEL_CHOICES,
    epilog=modes_help(),
)


def point(base: Settings, factor: str, value, pricing: str, reading: str | None) -> Settings:
    """The settings of one point: `base` with one factor at `value`, under `pricing` (and `reading`)."""
    s = base.replace(planner=base.planner.replace(assignment_pricing=pricing))
    if reading is not None:
        s = s.replace(hardware=s.hardware.replace(ratio_reading=reading))
    if factor == "fill":
        return s.replace(workload=s.workload.replace(fill=value, tokens_per_step=None))
    if factor == "ratio":
        return s.replace(hardware=s.hardware.replace(inter_intra_ratio=value))
    if factor == "long_share":
        return s.replace(workload=s.workload.replace(long_prob=value))
    if factor == "window":
        return s.replace(model=s.model.replace(sparse_params={**s.model.sparse_params, "window": value}))
    if factor == "kind":  # the kind with its declared defaults (prepare fills them in)
        return s.replace(model=s.model.replace(sparse_kind=value, sparse_params={}))
    if factor == "overlap":  # every mode's attention exchanges pipelined in `value` head blocks (a priced what-if)
        return s.replace(costs=s.costs.replace(overlap_blocks=value))
    if factor == "state":  # a linear kind's state, v_heads x head_k_dim x head_v_dim per sample: both head dims
        return s.replace(model=s.model.replace(sparse_params={**s.model.sparse_params, "head_k_dim": value, "head_v_dim": value}))
    # the cluster: as many long documents per step as on 64 ranks
    return s.replace(cluster=s.cluster.replace(world_size=value), workload=s.workload.replace(long_prob=s.workload.long_prob * 64 / value))


COLUMNS = [
    "factor",
    "value",
    "assignment_pricing",
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
    "whole_run_change_pct",
    "mean_inter_comm_s",
    "mean_imbalance_wait_s",
    "commit",
    "tree",
    "device",
    "time_utc",
    "command",
]


def points(factors):
    """(factor, value, pricing, reading): the ratio under both readings, every factor under both pricings."""
    for factor in factors:
        for value in SWEEP_FACTORS[factor]:
            for pricing in PRICINGS:
                for reading in RATIO_READINGS if factor == "ratio" else (None,):
                    yield factor, value, pricing, reading


# the sparse kind's parameter a factor sets (the kind must declare it), and the workload setting a
# factor varies (the run must read it: config.reads)
FACTOR_PARAMS = {"window": ("window",), "state": ("head_k_dim", "head_v_dim")}
FACTOR_SETTINGS = {"fill": "workload.fill", "long_share": "workload.long_prob"}


def check_factors(base: Settings) -> None:
    """SettingError naming the first factor of --factors this model and workload would not read
    (the window of a kind without one, a linear kind's state on an attention model, the fill of a
    trace), before any point runs."""
    kind = sparse_cost(base.model.sparse_kind)
    for factor in base.sweep.factors.split(","):
        where = f"{base.route('sweep.factors')}={base.sweep.factors!r}: factor {factor!r}"
        missing = [p for p in FACTOR_PARAMS.get(factor, ()) if p not in kind.params]
        if missing:
            raise SettingError(
                f"{where} sets the sparse kind's {missing[0]!r}, and model {base.model.name}'s kind {kind.name!r} has no such "
                f"parameter (its parameters: {sorted(kind.params)}): leave the factor out, or use a model whose kind has it"
            )
        why = unread_reason(base, FACTOR_SETTINGS[factor]) if factor in FACTOR_SETTINGS else None
        if why:
            raise SettingError(f"{where} is not read: {why}")


def main(argv=None):
    base = entry.parse(COMMAND, argv, resolve_workload=False)  # each point resolves its workload for its cluster
    opts = base.sweep
    todo = list(points(opts.factors.split(",")))
    with entry.user_errors():
        check_factors(base)
        prepared = []  # every point's settings checked before the first runs, and run as checked
        for factor, value, pricing, reading in todo:
            with entry.user_errors(f"at {factor}={value}: "):
                prepared.append(prepare(point(base, factor, value, pricing, reading)))
        check_output_dir(opts.out)
        lock_folder(opts.out)
    prov = provenance()
    seeds = list(range(base.workload.seed, base.workload.seed + opts.seeds))
    rows = []
    for (factor, value, pricing, _reading), settings in tqdm(list(zip(todo, prepared)), desc="sweep", file=sys.stderr):
        with entry.user_errors(f"at {factor}={value}: "):
            _, summary = run_ablation(settings, seeds, progress=False, whole=opts.whole_run)
        used_reading = summary["config"]["hardware"]["ratio_reading"]
        for seed, modes in summary["seeds"].items():
            for mode, e in modes.items():
                rows.append(
                    {
                        "factor": factor,
                        "value": value,
                        "assignment_pricing": pricing,
                        "ratio_reading": used_reading,
                        "seed": seed,
                        "mode": mode,
                        "selected_steps": e["steps"],
                        **{k: e.get(k) for k in COLUMNS if k in e},
                        "whole_run_change_pct": summary["whole_run"]["per_seed"][seed][mode] if opts.whole_run else "",
                        **{k: prov[k] for k in ("commit", "tree", "device", "time_utc", "command")},
                    }
                )
        over = summary["over_seeds"]
        if over:
            whole = summary.get("whole_run", {}).get("over_seeds", {})
            shown = ", ".join(
                f"{m} {over[m]['time_change_pct']['mean']:+.2f}%" + (f" (whole run {whole[m]['mean']:+.2f}%)" if m in whole else "")
                for m in modes_where(headline=True)
                if m in over
            )
            tqdm.write(f"{factor}={value} {pricing} {used_reading}: {shown}", file=sys.stderr)
    path = os.path.join(opts.out, "sweep.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})
    print(f"wrote {path} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
