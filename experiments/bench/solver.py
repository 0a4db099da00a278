"""Planning time of every mode, and the solvers against exact MILPs.

    python -m experiments.bench.solver            # 64 .. 4096 ranks (+ 16384, one step), 45 joint and 100 child instances
    python -m experiments.bench.solver --quick    # smaller, for a smoke run
    python -m experiments.bench.solver --ranks 16384 --fills 0.5   # one row, in a process of its own

A benchmark, not a test. It prints and writes (results/):
- solver_bench.csv: planning time per mode, cluster size and fill (--fills: half the cluster's
  tokens, and 0.95 as the ablation and a packed training step fill; one core, best of --repeats
  cold plans per step, every mode of a step timed in turn; median, p90 and max over steps), each
  mode's ratio to the baseline planner on the same step (median and most over the steps), and the
  simulator's own time per step (simulate, on each mode's plans) beside it. Targets: repack+widths
  under 100 ms median at 1024 ranks and under 500 ms at 4096; every mode within 2.3x the
  baseline planner;
- solver_bench_joint.csv: each mode's step estimate against the exact joint optimum
  (solver.exact.solve_joint_exact) on small instances (16 ranks, nodes of 4 or 8, budgets 16K or
  32K, 6-20 samples of which one or two are long): the share of the baseline-to-optimum gap each
  mode captures, in aggregate, and per-instance gaps to the optimum (median, p90, p95, max; the
  share within 5%). Targets: repack+widths captures >= 90% in aggregate and is within 5% on
  >= 95% of the instances;
- the child solver against its exact MILP (100 instances of a 16-rank parent).
"""

from __future__ import annotations

import contextlib
import csv
import gc
import os
import time

import numpy as np

from config import Cluster, CostsConfig, HardwareConfig, ModelConfig, WorkloadConfig
from config.cli import Command
from config.entries import SolverBenchOptions
from experiments.common import entry
from experiments.common.files import check_output_dir
from experiments.common.provenance import provenance
from experiments.common.workload import generate_steps
from solver import CostModel, make_plan, samples_from_lengths
from solver.children import child_problem, solve_child_problem, solve_sorted
from solver.exact import solve_exact
from solver.modes import MODES, REFERENCE, modes_where
from solver.simulator import simulate


def time_plans(samples, cluster: Cluster, cost: CostModel, modes, repeats: int) -> dict[str, float]:
    """Each mode's best of `repeats` plans of one step (timeit's practice against a busy machine),
    the modes taken in turn within each repeat, so that every mode of the step is timed in the same
    minutes (the machine's speed drifts between them). Each plan starts cold: the child-solution
    memo is cleared and garbage collected first, and each plan gets a fresh tuple of the samples
    (so it checks them once, as a new step would), so no plan profits from another's work or pays
    for another's garbage."""
    best = dict.fromkeys(modes, float("inf"))
    for _ in range(repeats):
        for mode in modes:
            solve_sorted.cache_clear()
            fresh = tuple(list(samples))  # a new tuple object (tuple() of a tuple returns it)
            gc.collect()
            t0 = time.perf_counter()
            make_plan(fresh, cluster, cost, mode)
            best[mode] = min(best[mode], time.perf_counter() - t0)
    return best


def time_simulate(plan, cost: CostModel, repeats: int) -> float:
    """Best of `repeats` runs of the simulator on one plan: its own time per step."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        simulate(plan, cost)
        best = min(best, time.perf_counter() - t0)
    return best


def planning_times(world_sizes, fills, workload: WorkloadConfig, cost: CostModel, tokens_per_rank: int, repeats: int = 3):
    """Planning time of every mode per cluster size and fill: `workload.steps` steps of `workload`
    per size at that fill of each cluster (the long-document rate is per document, so bigger steps
    hold proportionally more long documents), the largest size one step. Every mode plans each step
    in turn (time_plans); a mode's ratio to the reference (baseline) planner is taken per step, on
    the same step in the same minutes, and its median over the steps reported, with the
    simulator's time on its plans."""
    rows = []
    for fill in fills:
        for w in world_sizes:
            n_steps = 1 if w > 4096 else workload.steps  # the largest cluster: one step, its plans best of `repeats` as every other
            cluster = Cluster(w, 8, tokens_per_rank)
            steps = generate_steps(workload.replace(steps=n_steps, seed=w, fill=fill, tokens_per_step=None).for_cluster(cluster))
            bound = cost.for_cluster(cluster)
            ts, sims = {m: [] for m in MODES}, {m: [] for m in MODES}
            for lengths in steps:
                samples = samples_from_lengths(lengths)
                for mode, t in time_plans(samples, cluster, cost, MODES, repeats).items():
                    ts[mode].append(t)
                for mode in MODES:
                    sims[mode].append(time_simulate(make_plan(samples, cluster, cost, mode), bound, repeats))
            base = np.array(ts[REFERENCE])
            for mode in MODES:
                median = 1e3 * float(np.median(ts[mode]))
                rows.append(
                    {
                        "ranks": w,
                        "fill": fill,
                        "mode": mode,
                        "steps": len(steps),
                        "samples_per_step": int(np.mean([len(s) for s in steps])),
                        "median_ms": median,
                        "p90_ms": 1e3 * float(np.quantile(ts[mode], 0.9)),
                        "max_ms": 1e3 * float(np.max(ts[mode])),
                        "vs_baseline": float(np.median(np.array(ts[mode]) / base)),  # per step, then the median
                        "vs_baseline_max": float(np.max(np.array(ts[mode]) / base)),
                        "simulate_ms": 1e3 * float(np.median(sims[mode])),
                    }
                )
                r = rows[-1]
                print(
                    f"{w:6d} ranks fill {fill:.2f} {mode:15s} {r['samples_per_step']:6d} samples  median {median:8.1f} ms "
                    f"({r['vs_baseline']:.2f}x the baseline planner, step by step; at most {r['vs_baseline_max']:.2f}x)  "
                    f"p90 {r['p90_ms']:8.1f} ms  simulator {r['simulate_ms']:7.1f} ms" + ("  (one step)" if n_steps == 1 else ""),
                    flush=True,
                )
    return rows


def joint_instance(seed: int) -> tuple[Cluster, list[int]]:
    """A small joint instance: 16 ranks in nodes of 4 or 8, 16K or 32K tokens per rank, 6-20 samples:
    one or two long ones (over a rank's budget, their memory floors within half the cluster) and
    short ones (log-normal, median ~3K tokens), at most 85% of the cluster's tokens."""
    rng = np.random.default_rng(20_000 + seed)
    node, budget = (4, 8)[seed % 2], (16384, 32768)[(seed // 2) % 2]
    cluster = Cluster(16, node, budget)
    while True:
        n, n_long = int(rng.integers(6, 21)), 1 + (seed // 4) % 2
        longs = rng.integers(budget + 1, 10 * budget, n_long).tolist()
        short = np.clip(rng.lognormal(8.0, 1.0, n - n_long), 64, budget).astype(int).tolist()
        while len(short) > 4 and sum(longs) + sum(short) > 0.85 * 16 * budget:
            short.pop()
        floors = sum(cluster.min_group_size(x) for x in longs)
        if floors <= 8 and sum(longs) + sum(short) <= 0.85 * 16 * budget:
            return cluster, [int(x) for x in longs + short]


# The modes whose plans lie in the exact optimum's space (Ulysses children, the layout change
# folded into the all-to-alls) and which PlanEstimate prices whole; redistribute adds a pass and
# the halo modes a different child, which the simulator prices instead.
JOINT_MODES = modes_where(needs_reach=False, cheapest=False, folded=True)


def joint_gaps(n_instances: int, cost: CostModel, time_limit: float = 60.0) -> list[dict]:
    """Every mode's step estimate and the exact joint optimum, per instance."""
    from solver.estimate import PlanEstimate  # noqa: PLC0415
    from solver.exact import solve_joint_exact  # noqa: PLC0415

    rows = []
    for seed in range(n_instances):
        cluster, lengths = joint_instance(seed)
        samples = samples_from_lengths(lengths)
        est = PlanEstimate({s.id: s.length for s in samples}, cluster, cost)
        t0 = time.perf_counter()
        opt = solve_joint_exact(samples, cluster, cost, time_limit)
        row = {
            "instance": seed,
            "gpus_per_node": cluster.gpus_per_node,
            "tokens_per_rank": cluster.tokens_per_rank,
            "samples": len(lengths),
            "long_samples": sum(n > cluster.tokens_per_rank for n in lengths),
            "optimum_s": opt.time,
            "optimum_proven": opt.proven,
            "milp_s": time.perf_counter() - t0,
        }
        for mode in JOINT_MODES:
            row[f"{mode}_s"] = est.plan_time(make_plan(samples, cluster, cost, mode).parents)
        rows.append(row)
    return rows


def summarize_joint(rows: list[dict]) -> dict[str, dict]:
    """Per mode: the share of the summed baseline-to-optimum gap captured, and the per-instance gaps."""
    base = np.array([r["baseline_s"] for r in rows])
    opt = np.array([r["optimum_s"] for r in rows])
    out = {}
    for mode in JOINT_MODES:
        t = np.array([r[f"{mode}_s"] for r in rows])
        gap = t / opt - 1
        total = float((base - opt).sum())
        q = np.quantile(gap, [0.5, 0.9, 0.95, 1.0])
        out[mode] = {
            "captured_pct": 100 * float((base - t).sum()) / total if total > 0 else float("nan"),
            "within_5pct_pct": 100 * float(np.mean(gap <= 0.05)),
            "gap_median_pct": 100 * q[0],
            "gap_p90_pct": 100 * q[1],
            "gap_p95_pct": 100 * q[2],
            "gap_max_pct": 100 * q[3],
        }
    return out


def exact_gaps(n_instances: int, cost: CostModel):
    cluster = Cluster(16, 8, 32768)
    gaps, times = [], []
    for seed in range(n_instances):
        rng = np.random.default_rng(10_000 + seed)
        n = int(rng.integers(3, 13))
        lengths = np.clip(rng.lognormal(9.5, 1.2, n), 16, 200_000).astype(int)
        while lengths.sum() > 0.9 * 16 * 32768:
            lengths = lengths[:-1]
        p = child_problem(lengths, 16, cluster, cost)
        t0 = time.perf_counter()
        h = solve_child_problem(p)
        times.append(time.perf_counter() - t0)
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            e = solve_exact(p)
        gaps.append(h.makespan / e - 1)
    return np.array(gaps), np.array(times)


def _fills_ok(v: str) -> bool:
    try:
        return all(0 < float(x) <= 1 for x in v.split(","))
    except ValueError:
        return False


COMMAND = Command(
    "experiments.bench.solver",
    __doc__,
    (ModelConfig, HardwareConfig, CostsConfig, WorkloadConfig, SolverBenchOptions),
    defaults={"workload.steps": 10},
    only={"workload": ("steps",)},
)


def main(argv=None):
    s = entry.parse(COMMAND, argv, resolve_workload=False)  # resolved for each cluster size it plans
    args = s.bench
    with entry.user_errors():
        check_output_dir(args.out)
    cost = CostModel(s.model, s.hardware, costs=s.costs)  # bound to each cluster size it plans
    sizes = [64, 256] if args.quick else [int(x) for x in args.ranks.split(",")]
    ctx = provenance()
    core = "one thread"
    if hasattr(os, "sched_setaffinity"):  # Linux: pin to one core, as the target says
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        core = f"pinned to CPU {cpu}"
    print(f"planning time per step, one CPU core ({core}; {ctx['device']}, commit {ctx['commit']})")
    print("targets: repack+widths < 100 ms median at 1024 ranks, < 500 ms at 4096")
    print(f"each step: best of {args.repeats} cold plans (memo cleared, garbage collected before each)")
    workload = s.workload.replace(steps=3) if args.quick else s.workload
    fills = [float(x) for x in args.fills.split(",")]
    rows = planning_times(sizes, fills, workload, cost, Cluster().tokens_per_rank, args.repeats)
    joint = joint_gaps(8 if args.quick else 45, cost)
    proven = sum(r["optimum_proven"] for r in joint)
    print(f"\nevery mode against the exact joint optimum ({len(joint)} instances of 16 ranks, {proven} proven optimal):")
    print(f"{'mode':>15} {'gap captured':>13} {'within 5%':>10} {'gap median':>11} {'p90':>7} {'p95':>7} {'max':>7}")
    for mode, e in summarize_joint(joint).items():
        print(
            f"{mode:>15} {e['captured_pct']:12.1f}% {e['within_5pct_pct']:9.0f}% {e['gap_median_pct']:10.2f}% "
            f"{e['gap_p90_pct']:6.2f}% {e['gap_p95_pct']:6.2f}% {e['gap_max_pct']:6.2f}%"
        )
    gaps, times = exact_gaps(20 if args.quick else 100, cost)
    q = np.quantile(gaps, [0.5, 0.9, 0.95, 1.0])
    print(f"\nchild solver vs exact MILP (parent of 16 ranks, 3-12 samples, {len(gaps)} instances):")
    print(
        f"  within 5% of optimum: {100 * np.mean(gaps <= 0.05):.0f}%   gap median {100 * q[0]:.2f}%  "
        f"p90 {100 * q[1]:.2f}%  p95 {100 * q[2]:.2f}%  max {100 * q[3]:.2f}%   heuristic median {1e3 * np.median(times):.1f} ms"
    )
    os.makedirs(args.out, exist_ok=True)
    for name, table in (("solver_bench.csv", rows), ("solver_bench_joint.csv", joint)):
        path = os.path.join(args.out, name)
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]) + list(ctx))
            w.writeheader()
            for r in table:
                w.writerow({**r, **ctx})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
