"""The paper's ablation on the embedded simulator: baseline, repack, repack+solver, the control
baseline+solver (the parent solver without repacking), and repack+widths (the width-choosing
parent solver, beyond the paper: parents change width and share).

    python -m experiments.ablation                 # 5 seeds x 200 steps, the steps with SP16/32 parents
    python -m experiments.ablation --seeds 1       # one seed (a mean without its range is not a result)
    python -m experiments.ablation --help

For each workload seed, selects the steps among the first --steps whose baseline plan has a
parent wider than a node, plans each in every mode and simulates them. Prints each mode's
mean change vs baseline with its [min, max] over seeds next to the paper's figures, the time
breakdown (with the costs every mode pays) and both MFU conventions, and writes
results/<out>/steps.csv and summary.json (schema: experiments.results), with every setting.
Every input is checked before any work: a bad value is a one-line error that names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

from tqdm import tqdm

from solver import (
    MODES,
    Cluster,
    CostModel,
    HardwareConfig,
    ModelConfig,
    PlanError,
    TrainingConfig,
    make_plan,
    samples_from_lengths,
)
from solver.baseline import PRICINGS
from solver.cluster import check_positive_int
from solver.config import EP_PLACEMENTS, RATIO_READINGS, RECOMPUTE
from solver.cost import sparse_cost, with_sparse_defaults
from solver.simulator import simulate

from .context import run_context
from .results import PAPER, summarize, summarize_seeds, write_run
from .settings import check_output_dir, load_config_file
from .workload import DEFAULT_TOKENS_PER_RANK, WorkloadConfig, generate_steps, load_trace

# Packing practice fills each rank's micro-batch close to its token budget (DESIGN.md section 7:
# Megatron's dynamic context parallelism packs bins to a rank's capacity, concat-and-chunk fills
# every position). 1.0 cannot always be placed (whole documents, power-of-two groups), so 0.95.
DEFAULT_FILL = 0.95
DEFAULT_SEEDS = 5


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
    ap.add_argument("--seed", type=int, default=None, help="first workload seed (default 0)")
    ap.add_argument("--seeds", type=int, default=None, help=f"number of workload seeds, from --seed on (default {DEFAULT_SEEDS})")
    ap.add_argument("--steps", type=int, default=None, help="training steps to scan for SP16/32 parents, per seed (default 200)")
    ap.add_argument("--world-size", type=int, default=64, help="ranks in the cluster (default 64 = 8 nodes x 8)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (default 8)")
    ap.add_argument(
        "--tokens-per-rank", type=int, default=DEFAULT_TOKENS_PER_RANK, help=f"per-rank token budget (default {DEFAULT_TOKENS_PER_RANK})"
    )
    batch = ap.add_mutually_exclusive_group()
    batch.add_argument(
        "--fill",
        type=float,
        default=None,
        help=f"global batch per step as a fraction of world size x per-rank budget (default {DEFAULT_FILL}: packed batches)",
    )
    batch.add_argument("--tokens-per-step", type=int, default=None, help="global batch in tokens per step (instead of --fill)")
    ap.add_argument("--long-prob", type=float, default=None, help="per-document probability of a long document (default 5e-4)")
    ap.add_argument("--ratio", type=float, default=None, help="intra/inter-node all-to-all bandwidth ratio (default 7.0, the paper's)")
    ap.add_argument(
        "--ratio-reading",
        default=None,
        choices=list(RATIO_READINGS),
        help="what the ratio compares: group (default: a whole all-to-all across nodes runs at 1/ratio of the rate of one "
        "inside a node, the paper's 'effective all-to-all rate') or link (an inter-node byte costs ratio x an intra-node byte)",
    )
    ap.add_argument("--model", default="paper", help="model preset (default paper; see solver.config.MODEL_PRESETS)")
    ap.add_argument("--hardware", default="h100", help="hardware preset (default h100)")
    ap.add_argument("--training", default="default", help="training-cost preset: default (every cost a step pays) or bare")
    ap.add_argument("--sparse-kind", default=None, help="registered sparse-attention kind (default: the preset's)")
    ap.add_argument("--window", type=int, default=None, help="sliding window of the sparse layers (sliding_window only)")
    ap.add_argument("--chunk", type=int, default=None, help="chunk of the sparse layers (chunked only)")
    ap.add_argument("--recompute", default=None, choices=list(RECOMPUTE), help="activation recompute (default full)")
    ap.add_argument("--ep-degree", type=int, default=None, help="expert-parallel degree (default 8)")
    ap.add_argument("--ep-placement", default=None, choices=list(EP_PLACEMENTS), help="an EP group inside a node or across (default intra)")
    ap.add_argument("--moe-overlap", type=float, default=None, help="share of the experts' all-to-all hidden behind compute (default 0.8)")
    ap.add_argument("--no-moe-all-to-all", action="store_true", help="leave out the experts' all-to-all")
    ap.add_argument("--no-grad-sync", action="store_true", help="leave out the gradient reduce-scatter / all-gather")
    ap.add_argument("--no-optimizer", action="store_true", help="leave out the optimizer step")
    ap.add_argument(
        "--no-router-sync", action="store_true", help="leave out the router statistics' world all-reduce (a barrier per MoE layer)"
    )
    ap.add_argument(
        "--config", default=None, help="JSON file with 'model', 'hardware', 'training', 'cluster', 'workload' overrides (flags win)"
    )
    ap.add_argument("--trace", default=None, help="length trace (.csv step,length rows / .jsonl / .npy) instead of the generator")
    add_baseline_pricing_arg(ap)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise PlanError(message)


def _finite_in(name: str, v, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = v is not None and math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
    _check(ok, f"{name}={v!r} is invalid: use a number in {'(' if lo_open else '['}{lo}, {hi}]")


def build(args):
    """(model, hardware, training, cluster, workload, seeds) from presets, the config file and the
    flags, every value checked (PlanError names a bad one) before any work."""
    over = load_config_file(args.config) if args.config else {}
    wl_over = dict(over.get("workload", {}))
    seed_name = "--seed" if args.seed is not None else "workload.seed"
    seed = args.seed if args.seed is not None else wl_over.pop("seed", 0)
    wl_over.pop("seed", None)
    n_seeds = args.seeds if args.seeds is not None else DEFAULT_SEEDS
    steps = args.steps if args.steps is not None else wl_over.pop("steps", 200)
    wl_over.pop("steps", None)
    check_positive_int("--seeds", n_seeds)
    check_positive_int("--steps", steps)
    _check(isinstance(seed, int) and seed >= 0, f"{seed_name}={seed!r} is invalid: use an integer >= 0")

    model = ModelConfig.from_name(args.model, **over.get("model", {}))
    if args.sparse_kind:
        model = model.replace(sparse_kind=args.sparse_kind, sparse_params={})  # that kind's defaults
    for flag, param in (("window", "window"), ("chunk", "chunk")):
        value = getattr(args, flag)
        if value is not None:
            takes = sparse_cost(model.sparse_kind).params
            _check(param in takes, f"--{flag} is a parameter of another sparse kind; {model.sparse_kind!r} takes {takes}")
            check_positive_int(f"--{flag}", value)
            model = model.replace(sparse_params={**model.sparse_params, param: value})
    model = with_sparse_defaults(model)

    hw = HardwareConfig.from_name(args.hardware, **over.get("hardware", {}))
    if args.ratio is not None:
        _finite_in("--ratio", args.ratio, 0, 1e6, lo_open=True)
        hw = hw.replace(inter_intra_ratio=args.ratio)
    if args.ratio_reading is not None:
        hw = hw.replace(ratio_reading=args.ratio_reading)

    training = TrainingConfig.from_name(args.training, **over.get("training", {}))
    flags = {"recompute": args.recompute, "ep_degree": args.ep_degree, "ep_placement": args.ep_placement, "moe_overlap": args.moe_overlap}
    training = training.replace(**{k: v for k, v in flags.items() if v is not None})
    switches = (
        ("no_moe_all_to_all", "moe_all_to_all"),
        ("no_grad_sync", "grad_sync"),
        ("no_optimizer", "optimizer"),
        ("no_router_sync", "router_sync"),
    )
    for flag, field_name in switches:
        if getattr(args, flag):
            training = training.replace(**{field_name: False})

    cl = {"world_size": args.world_size, "gpus_per_node": args.gpus_per_node, "tokens_per_rank": args.tokens_per_rank}
    cl.update(over.get("cluster", {}))
    cluster = Cluster(**cl)

    if args.tokens_per_step is not None:
        check_positive_int("--tokens-per-step", args.tokens_per_step)
        tokens_per_step, fill = args.tokens_per_step, args.tokens_per_step / (cluster.world_size * cluster.tokens_per_rank)
    else:
        fill = args.fill if args.fill is not None else DEFAULT_FILL
        _finite_in("--fill", fill, 0, 1, lo_open=True)
        tokens_per_step = int(fill * cluster.world_size * cluster.tokens_per_rank)
    wl = WorkloadConfig.from_dict({**wl_over, "steps": steps, "tokens_per_step": tokens_per_step})
    if args.long_prob is not None:
        _finite_in("--long-prob", args.long_prob, 0, 1)
        wl = dataclasses.replace(wl, long_prob=args.long_prob)
    return model, hw, training, cluster, wl, list(range(seed, seed + n_seeds)), fill


def step_lengths(args, wl: WorkloadConfig) -> list[tuple[int, list[int]]]:
    """(step number, lengths) of the steps to scan: the generator's, or the trace's with its own numbers."""
    if args.trace:
        return load_trace(args.trace)[: wl.steps]
    return list(enumerate(generate_steps(wl)))


def select_wide_steps(steps, cluster: Cluster, cost: CostModel, progress=True, pricing: str = "compute") -> list[int]:
    """Indices (into `steps`) of the steps whose baseline plan has a parent wider than a node."""
    chosen = []
    for i, (number, lengths) in enumerate(tqdm(steps, desc="scanning steps", disable=not progress, file=sys.stderr, leave=False)):
        try:
            plan = make_plan(samples_from_lengths(lengths), cluster, cost, "baseline", pricing)
        except PlanError as e:
            raise PlanError(f"step {number}: {e}") from None
        if plan.widest_parent > cluster.gpus_per_node:
            chosen.append(i)
    return chosen


def anchor_load_ratio(plan) -> float | None:
    """Max over the plan's wide parents: tokens per rank of the layout that holds its longest
    sample (its anchor child, or the parent itself when not repacked) over the step's mean tokens
    per rank. Above 1, the anchor child carries more token-wise work than an average rank. A wide
    parent left without samples (a solver may leave ranks idle) has no anchor; None when no wide
    parent holds any."""
    wide = [p for p in plan.wide_parents() if p.group.samples]
    if not wide:
        return None
    mean = sum(n for _, n in plan.lengths) / plan.cluster.world_size
    out = 0.0
    for p in wide:
        anchor = max(p.group.samples, key=lambda s: plan.length_of[s])
        holder = next(c for c in p.children if anchor in c.samples)
        out = max(out, sum(plan.length_of[s] for s in holder.samples) / holder.size / mean)
    return out


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
        "anchor_load_ratio": anchor_load_ratio(plan),
        "plan_hash": plan.hash,
        "plan_ms": round(plan_ms, 3),
    }
    return row, plan


def simulate_row(row: dict, plan, cost: CostModel) -> dict:
    r = simulate(plan, cost)
    row.update(
        step_time_s=r.step_time,
        mfu=r.mfu,
        mfu_noncausal=r.mfu_noncausal,
        lower_bound_s=r.lower_bound,
        compute_s=r.compute,
        intra_comm_s=r.intra_comm,
        inter_comm_s=r.inter_comm,
        moe_comm_s=r.moe_comm,
        grad_sync_s=r.grad_sync,
        optimizer_s=r.optimizer,
        imbalance_wait_s=r.imbalance_wait,
        full_intra_bytes=r.full_intra_bytes,
        full_inter_bytes=r.full_inter_bytes,
        sparse_intra_bytes=r.sparse_intra_bytes,
        sparse_inter_bytes=r.sparse_inter_bytes,
        exchange_full_s=r.full_exchange,
        exchange_sparse_s=r.sparse_exchange,
        model_flops=r.model_flops,
    )
    return row


def run_ablation(args, progress=True, built=None) -> tuple[list[dict], dict]:
    """The ablation of `args` (`built`: build(args) when the caller already checked it)."""
    model, hw, training, cluster, wl, seeds, fill = built if built is not None else build(args)
    cost = CostModel(model, hw, training=training).for_cluster(cluster)
    rows, selected = [], {}
    for seed in seeds:
        swl = dataclasses.replace(wl, seed=seed)
        steps = step_lengths(args, swl)
        chosen = select_wide_steps(steps, cluster, cost, progress, args.baseline_pricing)
        selected[str(seed)] = [steps[i][0] for i in chosen]
        for i in tqdm(chosen, desc=f"seed {seed}: {len(MODES)} modes", disable=not progress, file=sys.stderr, leave=False):
            number, lengths = steps[i]
            for mode in MODES:
                row, plan = plan_row(number, lengths, cluster, cost, mode, pricing=args.baseline_pricing)
                rows.append({"seed": seed, **simulate_row(row, plan, cost)})
        if args.trace:
            break  # a trace is one workload: seeds do not change it
    per_seed, over_seeds = summarize_seeds(rows) if rows else ({}, {})
    summary = {
        "engine": "sim",
        "context": run_context(),
        "config": {
            "model": model.to_dict(),
            "hardware": hw.to_dict(),
            "training": training.to_dict(),
            "cluster": dataclasses.asdict(cluster),
            "workload": wl.to_dict(),
            "fill": fill,
            "seeds": seeds[:1] if args.trace else seeds,
            "trace": args.trace,
            "steps_scanned": wl.steps,
            "baseline_pricing": args.baseline_pricing,
            "group_rate_ratios": group_rate_ratios(cost, cluster),
        },
        "selected_steps": selected,
        "modes": summarize(rows) if rows else {},
        "seeds": per_seed,
        "over_seeds": over_seeds,
        "paper": PAPER,
    }
    return rows, summary


def group_rate_ratios(cost: CostModel, cluster: Cluster) -> dict[str, float]:
    """The all-to-all rate of an SP8 group over that of SP16 and SP32 groups, as the cost model
    prices them (what the ratio and its reading imply)."""
    out, g = {}, cluster.gpus_per_node
    for wide in (2 * g, 4 * g):
        if wide <= cluster.world_size:
            out[f"SP{g}/SP{wide}"] = cost.group_rate(g) / cost.group_rate(wide)
    return out


def _range(e, key, scale=1.0, fmt="+.2f") -> str:
    v = e.get(key) if e else None
    if v is None:
        return "n/a"
    return f"{scale * v['mean']:{fmt}} [{scale * v['min']:{fmt}}, {scale * v['max']:{fmt}}]"


def print_tables(rows, summary, out=None):
    p = lambda *a: print(*a, file=out or sys.stdout)
    cfg = summary["config"]
    cl, hw, tr = cfg["cluster"], cfg["hardware"], cfg["training"]
    seeds = cfg["seeds"]
    n_selected = {s: len(v) for s, v in summary["selected_steps"].items()}
    p(
        f"\ncluster {cl['world_size']} ranks ({cl['gpus_per_node']}/node, {cl['tokens_per_rank']} tokens/rank), fill "
        f"{cfg['fill']:.2f}, model {cfg['model']['name']} ({cfg['model']['sparse_kind']} {cfg['model']['sparse_params']}), "
        f"baseline pricing {cfg['baseline_pricing']}"
    )
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in cfg["group_rate_ratios"].items())
    crossing = f", +{1e6 * hw['a2a_inter_latency']:.0f} us per call across nodes" if hw.get("a2a_inter_latency") else ""
    p(f"inter/intra ratio {hw['inter_intra_ratio']} read per {hw['ratio_reading']}: group all-to-all rates {ratios}{crossing}")
    experts = f"EP{tr['ep_degree']} {tr['ep_placement']}-node, {100 * tr['moe_overlap']:.0f}% hidden" if tr["moe_all_to_all"] else "off"
    grad = f"{100 * tr['grad_sync_overlap']:.0f}% hidden" if tr["grad_sync"] else "off"
    p(
        f"costs every mode pays: recompute {tr['recompute']}, experts' all-to-all {experts}, gradient sync {grad}, "
        f"optimizer {'on' if tr['optimizer'] else 'off'}, router statistics "
        f"{'a world barrier per MoE layer' if tr.get('router_sync', False) else 'off'}"
    )
    p(
        f"seeds {seeds}: {sum(n_selected.values())} selected steps with SP16/32 parents "
        f"({', '.join(str(n) for n in n_selected.values())} of {cfg['steps_scanned']} per seed; the paper: 22 of 200)"
    )
    if not rows:
        p("no step needs a parent wider than a node: nothing to compare (try more steps or --long-prob)")
        return
    over, modes, paper = summary["over_seeds"], summary["modes"], summary["paper"]
    p("\nchange vs baseline: mean over seeds [min, max]                                     | the paper")
    head = f"{'step time %':>24} {'MFU pp':>24} {'MFU pp (non-causal)':>24} {'gain captured %':>22}"
    p(f"{'mode':>15} | {head} | {'time %':>7} {'MFU pp':>7}")
    for m in MODES:
        e = over.get(m)
        pap = paper.get(m)
        pap_s = f"{pap['time_change_pct']:+7.2f} {pap['mfu_change_pp']:+7.2f}" if pap else f"{'-':>7} {'-':>7}"
        p(
            f"{m:>15} | {_range(e, 'time_change_pct'):>24} {_range(e, 'mfu_change_pp'):>24} {_range(e, 'mfu_noncausal_change_pp'):>24} "
            f"{_range(e, 'captured_gain_frac', 100, '.1f'):>22} | {pap_s}"
        )
    b = over["baseline"]
    p(
        f"\nbaseline MFU: ours {_range(b, 'mean_mfu', 100, '.1f')} % (causal), {_range(b, 'mean_mfu_noncausal', 100, '.1f')} % "
        f"(non-causal); the paper ~{paper['derived_baseline_mfu_pct']:.0f}% (derived, convention not given)"
    )
    if "baseline+solver" in modes and "repack+solver" in modes:
        rs, bs = modes["repack+solver"]["time_change_pct"], modes["baseline+solver"]["time_change_pct"]
        wide = sum(r["wide_parents"] for r in rows if r["mode"] == "repack+solver")
        p(
            f"attribution (all selected steps pooled): repack+solver {rs:+.2f}%, of which the parent solver alone (baseline+solver) "
            f"{bs:+.2f}%; repack+solver repacks {_repacked_wide(rows)} of its {wide} wide parents"
        )
    p("\nmean breakdown per rank (s), all selected steps pooled")
    cols = [
        ("compute", "compute_s"),
        ("intra-comm", "intra_comm_s"),
        ("inter-comm", "inter_comm_s"),
        ("experts' a2a", "moe_comm_s"),
        ("grad sync", "grad_sync_s"),
        ("optimizer", "optimizer_s"),
        ("imbalance", "imbalance_wait_s"),
    ]
    p(f"{'mode':>15} " + " ".join(f"{name:>12}" for name, _ in cols) + f" {'step':>8}")
    for m in MODES:
        e = modes[m]
        p(f"{m:>15} " + " ".join(f"{e['mean_' + k]:12.3f}" for _, k in cols) + f" {e['mean_step_time_s']:8.3f}")


def _repacked_wide(rows) -> int:
    """Wide parents repack+solver repacks (node-local parents are never repacked)."""
    return sum(r["repacked_parents"] for r in rows if r["mode"] == "repack+solver")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--out", default="results/ablation", help="output folder (default results/ablation)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        built = build(args)  # every input checked before any work, and before anything is written
        check_output_dir(args.out)
        rows, summary = run_ablation(args, progress=not args.no_progress, built=built)
    except PlanError as e:
        sys.exit(f"error: {e}")
    print_tables(rows, summary)
    csv_path, json_path = write_run(args.out, rows, summary)
    ctx = summary["context"]
    print(f"\nwrote {csv_path} and {json_path}  (commit {ctx['commit']}, {ctx['device']}, {time.time() - t0:.1f} s)")
    return rows, summary


if __name__ == "__main__":
    main()
