"""The paper's ablation on the embedded simulator: baseline, repack, repack+solver.

    python -m experiments.ablation                 # 200 steps, seed 0, the steps with SP16/32 parents
    python -m experiments.ablation --help

Selects the steps among the first --steps whose baseline plan has a parent wider than a node,
plans each in the three modes, simulates them, prints the per-step and mean tables next to the
paper's figures, and writes results/<out>/steps.csv and summary.json (schema: experiments.results).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from tqdm import tqdm

from solver import MODES, Cluster, CostModel, HardwareConfig, ModelConfig, PlanError, make_plan, samples_from_lengths
from solver.baseline import PRICINGS
from solver.config import load_config_file
from solver.simulator import simulate

from .context import run_context
from .results import PAPER, summarize, write_run
from .workload import (
    DEFAULT_STEP_TOKENS_PER_RANK,
    DEFAULT_TOKENS_PER_RANK,
    WorkloadConfig,
    default_tokens_per_step,
    generate_steps,
    load_trace,
)


def add_baseline_pricing_arg(ap: argparse.ArgumentParser) -> None:
    """--baseline-pricing, shared with the training driver."""
    ap.add_argument(
        "--baseline-pricing",
        default="compute",
        choices=list(PRICINGS),
        help="what the baseline parent assignment balances: compute (the design's baseline: attention + "
        "token-wise work) or comm (also each group's all-to-alls, FlexSP-like). Default compute",
    )


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--steps", type=int, default=200, help="training steps to scan for SP16/32 parents (default 200)")
    ap.add_argument("--world-size", type=int, default=64, help="ranks in the cluster (default 64 = 8 nodes x 8)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (default 8)")
    ap.add_argument(
        "--tokens-per-rank", type=int, default=DEFAULT_TOKENS_PER_RANK, help=f"per-rank token budget (default {DEFAULT_TOKENS_PER_RANK})"
    )
    ap.add_argument(
        "--tokens-per-step",
        type=int,
        default=None,
        help=f"global batch in tokens (default {DEFAULT_STEP_TOKENS_PER_RANK} x world size)",
    )
    ap.add_argument("--long-prob", type=float, default=None, help="per-document probability of a long document (default 5e-4)")
    ap.add_argument("--ratio", type=float, default=None, help="intra/inter-node all-to-all bandwidth ratio (default 7.0, the paper's)")
    ap.add_argument("--model", default="paper", help="model preset (default paper; see solver.config.MODEL_PRESETS)")
    ap.add_argument("--hardware", default="h100", help="hardware preset (default h100)")
    ap.add_argument("--sparse-kind", default=None, help="registered sparse-attention kind (default: the preset's)")
    ap.add_argument("--window", type=int, default=None, help="sliding window of the sparse layers (default: the preset's)")
    ap.add_argument("--config", default=None, help="JSON file with 'model', 'hardware', 'cluster', 'workload' overrides")
    ap.add_argument("--trace", default=None, help="length trace (.csv step,length rows / .jsonl / .npy) instead of the generator")
    add_baseline_pricing_arg(ap)


def build(args):
    """(model, hardware, cluster, workload) from presets, the config file and the flags."""
    over = load_config_file(args.config) if args.config else {}
    model = ModelConfig.from_name(args.model, **over.get("model", {}))
    if args.sparse_kind:
        model = model.replace(sparse_kind=args.sparse_kind)
    if args.window:
        model = model.replace(sparse_params={**model.sparse_params, "window": args.window})
    hw = HardwareConfig.from_name(args.hardware, **over.get("hardware", {}))
    if args.ratio is not None:
        hw = hw.replace(inter_intra_ratio=args.ratio)
    cl = {"world_size": args.world_size, "gpus_per_node": args.gpus_per_node, "tokens_per_rank": args.tokens_per_rank}
    cl.update(over.get("cluster", {}))
    cluster = Cluster(**cl)
    wl = dataclasses.replace(
        WorkloadConfig(),
        **over.get("workload", {}),
        seed=args.seed,
        steps=args.steps,
        tokens_per_step=args.tokens_per_step or default_tokens_per_step(cluster.world_size),
    )
    if args.long_prob is not None:
        wl = dataclasses.replace(wl, long_prob=args.long_prob)
    return model, hw, cluster, wl


def step_lengths(args, wl: WorkloadConfig) -> list[list[int]]:
    if args.trace:
        steps = load_trace(args.trace)
        return steps[: args.steps]
    return generate_steps(wl)


def select_wide_steps(steps, cluster: Cluster, cost: CostModel, progress=True, pricing: str = "compute") -> list[int]:
    """Indices of steps whose baseline plan has a parent wider than a node."""
    chosen = []
    for i, lengths in enumerate(tqdm(steps, desc="scanning steps", disable=not progress, file=sys.stderr)):
        try:
            plan = make_plan(samples_from_lengths(lengths), cluster, cost, "baseline", pricing)
        except PlanError as e:
            raise PlanError(f"step {i}: {e}") from None
        if plan.widest_parent > cluster.gpus_per_node:
            chosen.append(i)
    return chosen


def plan_row(step: int, lengths, cluster, cost, mode: str, engine: str = "sim", pricing: str = "compute") -> tuple[dict, object]:
    t0 = time.perf_counter()
    plan = make_plan(samples_from_lengths(lengths), cluster, cost, mode, pricing)
    plan_ms = 1e3 * (time.perf_counter() - t0)
    row = {
        "engine": engine,
        "mode": mode,
        "step": step,
        "n_samples": len(lengths),
        "tokens": int(sum(lengths)),
        "longest": int(max(lengths)),
        "widest_parent": plan.widest_parent,
        "wide_parents": len(plan.wide_parents()),
        "repacked_parents": sum(p.repacked for p in plan.parents),
        "plan_hash": plan.hash,
        "plan_ms": round(plan_ms, 3),
    }
    return row, plan


def run_ablation(args, progress=True) -> tuple[list[dict], dict]:
    model, hw, cluster, wl = build(args)
    cost = CostModel(model, hw)
    steps = step_lengths(args, wl)
    chosen = select_wide_steps(steps, cluster, cost, progress, args.baseline_pricing)
    rows = []
    for i in tqdm(chosen, desc="ablation (3 modes)", disable=not progress, file=sys.stderr):
        for mode in MODES:
            row, plan = plan_row(i, steps[i], cluster, cost, mode, pricing=args.baseline_pricing)
            r = simulate(plan, cost)
            row.update(
                step_time_s=r.step_time,
                mfu=r.mfu,
                lower_bound_s=r.lower_bound,
                compute_s=r.compute,
                intra_comm_s=r.intra_comm,
                inter_comm_s=r.inter_comm,
                imbalance_wait_s=r.imbalance_wait,
                full_intra_bytes=r.full_intra_bytes,
                full_inter_bytes=r.full_inter_bytes,
                sparse_intra_bytes=r.sparse_intra_bytes,
                sparse_inter_bytes=r.sparse_inter_bytes,
                model_flops=r.model_flops,
            )
            rows.append(row)
    summary = {
        "engine": "sim",
        "context": run_context(),
        "config": {
            "model": model.to_dict(),
            "hardware": hw.to_dict(),
            "cluster": dataclasses.asdict(cluster),
            "workload": wl.to_dict(),
            "trace": args.trace,
            "steps_scanned": len(steps),
        },
        "selected_steps": chosen,
        "modes": summarize(rows) if rows else {},
        "paper": PAPER,
    }
    return rows, summary


def print_tables(rows, summary, out=None):
    p = lambda *a: print(*a, file=out or sys.stdout)
    cfg = summary["config"]
    n_scanned = cfg["steps_scanned"]
    chosen = summary["selected_steps"]
    p(
        f"\n{len(chosen)} of {n_scanned} steps have SP16/32 parents (the paper: 22 of 200)   "
        f"cluster {cfg['cluster']['world_size']} ranks, {cfg['cluster']['gpus_per_node']}/node, "
        f"model {cfg['model']['name']}, inter/intra ratio {cfg['hardware']['inter_intra_ratio']}"
    )
    if not rows:
        p("no step needs a parent wider than a node: nothing to compare (try more steps or --long-prob)")
        return
    by = {(r["step"], r["mode"]): r for r in rows}
    p(f"\n{'step':>5} {'samples':>7} {'longest':>8} | " + " | ".join(f"{m:>20}" for m in MODES))
    p(f"{'':>5} {'':>7} {'':>8} | " + " | ".join(f"{'time s':>9} {'MFU %':>10}" for _ in MODES))
    for s in chosen:
        b = by[(s, "baseline")]
        cells = " | ".join(f"{by[(s, m)]['step_time_s']:9.3f} {100 * by[(s, m)]['mfu']:10.2f}" for m in MODES)
        p(f"{s:5d} {b['n_samples']:7d} {b['longest']:8d} | {cells}")
    modes = summary["modes"]
    paper = summary["paper"]
    p("\nmean over the selected steps             ours                                   | the paper")
    p(f"{'mode':>14} | {'step s':>8} {'change':>8} {'MFU %':>7} {'change':>9} {'gain captured':>14} | {'change':>8} {'MFU change':>11}")
    for m in MODES:
        e = modes[m]
        cap = e["captured_gain_frac"]
        cap_s = f"{100 * cap:13.1f}%" if cap is not None else f"{'n/a':>14}"
        p(
            f"{m:>14} | {e['mean_step_time_s']:8.3f} {e['time_change_pct']:+7.2f}% {100 * e['mean_mfu']:7.2f} "
            f"{e['mfu_change_pp']:+7.2f}pp {cap_s} | {paper[m]['time_change_pct']:+7.2f}% {paper[m]['mfu_change_pp']:+9.2f}pp"
        )
    b = modes["baseline"]
    p(
        f"\nbaseline MFU: ours {100 * b['mean_mfu']:.1f}%, paper ~{paper['derived_baseline_mfu_pct']:.0f}% (derived)."
        f"  lower bound (perfect balance, no inter-node sparse traffic): {b['mean_lower_bound_s']:.3f} s"
    )
    p("mean breakdown per rank (s):   compute  intra-comm  inter-comm  imbalance-wait")
    for m in MODES:
        e = modes[m]
        p(
            f"{m:>14}              {e['mean_compute_s']:8.3f} {e['mean_intra_comm_s']:10.3f} {e['mean_inter_comm_s']:11.3f} "
            f"{e['mean_imbalance_wait_s']:14.3f}"
        )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--out", default="results/ablation", help="output folder (default results/ablation)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        rows, summary = run_ablation(args, progress=not args.no_progress)
    except PlanError as e:
        sys.exit(f"error: {e}")
    print_tables(rows, summary)
    csv_path, json_path = write_run(args.out, rows, summary)
    ctx = summary["context"]
    print(f"\nwrote {csv_path} and {json_path}  (commit {ctx['commit']}, {ctx['device']}, {time.time() - t0:.1f} s)")
    return rows, summary


if __name__ == "__main__":
    main()
