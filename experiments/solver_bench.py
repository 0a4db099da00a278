"""Planning-time benchmark and heuristic-vs-exact gap of the child solver.

    python -m experiments.solver_bench            # full table (64 .. 4096 ranks) and 100 exact instances
    python -m experiments.solver_bench --quick    # smaller, for a smoke run

A benchmark, not a test: it prints figures and writes results/solver_bench.csv.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import os
import sys
import time

import numpy as np

from solver import MODES, Cluster, CostModel, HardwareConfig, ModelConfig, PlanError, make_plan, samples_from_lengths
from solver.children import child_problem, solve_child_problem, solve_sorted
from solver.cluster import check_positive_int
from solver.exact import solve_exact

from .context import run_context
from .settings import check_output_dir
from .workload import DEFAULT_TOKENS_PER_RANK, WorkloadConfig, default_tokens_per_step, generate_steps


def time_plan(samples, cluster: Cluster, cost: CostModel, mode: str, repeats: int) -> float:
    """Best of `repeats` plans of one step (timeit's practice against a busy machine). Each
    starts cold: the child-solution memo is cleared and garbage collected first, so no run
    profits from another's solves or pays for another's garbage."""
    best = float("inf")
    for _ in range(repeats):
        solve_sorted.cache_clear()
        gc.collect()
        t0 = time.perf_counter()
        make_plan(samples, cluster, cost, mode)
        best = min(best, time.perf_counter() - t0)
    return best


def planning_times(world_sizes, steps_per_size: int, cost: CostModel, tokens_per_rank: int, repeats: int = 3):
    rows = []
    for w in world_sizes:
        # the default step per rank; the long-document rate is per document, so bigger steps hold
        # proportionally more long documents
        wl = WorkloadConfig(steps=steps_per_size, tokens_per_step=default_tokens_per_step(w), seed=w)
        steps = generate_steps(wl)
        cluster = Cluster(w, 8, tokens_per_rank)
        for mode in MODES:
            ts = [time_plan(samples_from_lengths(lengths), cluster, cost, mode, repeats) for lengths in steps]
            rows.append(
                {
                    "ranks": w,
                    "mode": mode,
                    "samples_per_step": int(np.mean([len(s) for s in steps])),
                    "median_ms": 1e3 * float(np.median(ts)),
                    "p90_ms": 1e3 * float(np.quantile(ts, 0.9)),
                    "max_ms": 1e3 * float(np.max(ts)),
                }
            )
            print(
                f"{w:6d} ranks  {mode:14s} {rows[-1]['samples_per_step']:6d} samples  "
                f"median {rows[-1]['median_ms']:8.1f} ms  p90 {rows[-1]['p90_ms']:8.1f} ms  max {rows[-1]['max_ms']:8.1f} ms",
                flush=True,
            )
    return rows


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 and 256 ranks, 20 exact instances")
    ap.add_argument("--steps", type=int, default=10, help="steps planned per cluster size")
    ap.add_argument("--repeats", type=int, default=3, help="plans per step; the best counts (default 3)")
    ap.add_argument("--out", default="results", help="output folder")
    args = ap.parse_args(argv)
    try:
        check_positive_int("--steps", args.steps)
        check_positive_int("--repeats", args.repeats)
        check_output_dir(args.out)
    except PlanError as e:
        sys.exit(f"error: {e}")
    cost = CostModel(ModelConfig.from_name("paper"), HardwareConfig())
    sizes = [64, 256] if args.quick else [64, 256, 1024, 4096]
    ctx = run_context()
    core = "one thread"
    if hasattr(os, "sched_setaffinity"):  # Linux: pin to one core, as the target says
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        core = f"pinned to CPU {cpu}"
    print(f"planning time per step, one CPU core ({core}; {ctx['device']}, commit {ctx['commit']}); target: < 100 ms at 1024 ranks")
    print(f"each step: best of {args.repeats} cold plans (memo cleared, garbage collected before each)")
    rows = planning_times(sizes, 3 if args.quick else args.steps, cost, DEFAULT_TOKENS_PER_RANK, args.repeats)
    gaps, times = exact_gaps(20 if args.quick else 100, cost)
    q = np.quantile(gaps, [0.5, 0.9, 0.95, 1.0])
    print(f"\nchild solver vs exact MILP (parent of 16 ranks, 3-12 samples, {len(gaps)} instances):")
    print(
        f"  within 5% of optimum: {100 * np.mean(gaps <= 0.05):.0f}%   gap median {100 * q[0]:.2f}%  "
        f"p90 {100 * q[1]:.2f}%  p95 {100 * q[2]:.2f}%  max {100 * q[3]:.2f}%   heuristic median {1e3 * np.median(times):.1f} ms"
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "solver_bench.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) + list(ctx))
        w.writeheader()
        for r in rows:
            w.writerow({**r, **ctx})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
