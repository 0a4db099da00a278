"""The ablation on the embedded simulator, for its entry point (python -m experiments.ablation),
the sweep and the notebooks: its command line (COMMAND), and the run itself: select the steps
with parents wider than a node, plan each in every mode, simulate, summarize over seeds, print
the tables."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from tqdm import tqdm

from config import Cluster, CostsConfig, HardwareConfig, ModelConfig, PlannerConfig, WorkloadConfig
from config.cli import Command, Settings
from config.entries import AblationOptions
from config.reads import data_source
from experiments.common.lengths import describe
from experiments.common.provenance import provenance
from experiments.common.results import PAPER, summarize, summarize_seeds
from experiments.common.settings import MODEL_CHOICES, cost_model
from experiments.common.workload import check_generation, workload_steps
from solver import CostModel, PlanError, make_plan, samples_from_lengths
from solver.modes import CHILDREN, MODE_TABLE, MODES, OWN, REFERENCE, modes_for, modes_help, twin
from solver.simulator import simulate

DESCRIPTION = """The paper's ablation on the embedded simulator: every mode (listed below, from the mode table)
on the same steps, the paper's three (baseline, repack, repack+solver) and the others beside them.

    python -m experiments.ablation                 # 5 seeds x 200 steps, the steps with SP16/32 parents
    python -m experiments.ablation --seeds 1       # one seed (a mean without its range is not a result)
    python -m experiments.ablation --help          # every setting, by section

For each workload seed, selects the steps among the first --steps whose baseline plan has a
parent wider than a node, plans each in every mode and simulates them. Prints each mode's
mean change vs baseline with its [min, max] over seeds next to the paper's figures, the time
breakdown (with the costs every mode pays) and both MFU conventions, and writes
<out>/steps.csv and summary.json (schema: experiments.common.results), with every setting.
Every input is checked before any work: a bad value is a one-line error that names it.
"""
SECTIONS = (ModelConfig, HardwareConfig, Cluster, CostsConfig, WorkloadConfig, PlannerConfig)
COMMAND = Command("experiments.ablation", DESCRIPTION, (*SECTIONS, AblationOptions), choices=MODEL_CHOICES, epilog=modes_help())


def select_wide_steps(steps, cluster: Cluster, cost: CostModel, progress=True, pricing: str = "compute", where: str = "") -> list[int]:
    """Indices (into `steps`) of the steps whose baseline plan has a parent wider than a node;
    `where` names the steps' source in an error (--trace='t.csv')."""
    chosen = []
    for i, (number, lengths) in enumerate(tqdm(steps, desc="scanning steps", disable=not progress, file=sys.stderr, leave=False)):
        try:
            plan = make_plan(samples_from_lengths(lengths), cluster, cost, REFERENCE, pricing)
        except PlanError as e:
            raise PlanError(f"{where + ' ' if where else ''}step {number}: {e}") from None
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
        **plan.parent_counts(),
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
        moe_intra_bytes=r.moe_intra_bytes,
        moe_inter_bytes=r.moe_inter_bytes,
        exchange_full_s=r.full_exchange,
        exchange_sparse_s=r.sparse_exchange,
        exchange_moe_s=r.moe_exchange,
        model_flops=r.model_flops,
    )
    return row


def _seed_rows(job: tuple[Settings, int, bool]) -> tuple[list[dict], list[int], dict]:
    """One seed of the ablation: (its rows per selected step and mode, the selected steps' numbers,
    and with --whole-run every mode's seconds over the other steps and how many they are)."""
    settings, seed, progress = job
    cluster, wl, pricing = settings.cluster, settings.workload, settings.planner.assignment_pricing
    cost = cost_model(settings)
    modes = ablation_modes(cost)
    steps = workload_steps(dataclasses.replace(wl, seed=seed))
    chosen = select_wide_steps(steps, cluster, cost, progress, pricing, data_source(settings))
    rows = []
    for i in tqdm(chosen, desc=f"seed {seed}: {len(modes)} modes", disable=not progress, file=sys.stderr, leave=False):
        number, lengths = steps[i]
        for mode in modes:
            row, plan = plan_row(number, lengths, cluster, cost, mode, pricing=pricing)
            rows.append({"seed": seed, **simulate_row(row, plan, cost)})
    rest = {}
    if "ablation" in settings.sections and settings.ablation.whole_run:
        others = [steps[i][1] for i in sorted(set(range(len(steps))) - set(chosen))]
        rest = {"steps": len(steps), "seconds": {m: 0.0 for m in modes}}
        for lengths in tqdm(others, desc=f"seed {seed}: the other steps", disable=not progress, file=sys.stderr, leave=False):
            for mode in modes:
                plan = make_plan(samples_from_lengths(lengths), cluster, cost, mode, pricing)
                rest["seconds"][mode] += simulate(plan, cost).step_time
    return rows, [steps[i][0] for i in chosen], rest


def seed_workloads(settings: Settings, seeds: list[int]) -> list[WorkloadConfig]:
    """The workload of each seed the ablation runs (prepared settings): one for a trace, which is
    one fixed workload (config.reads refuses --seeds given with it); SettingError before any is
    drawn when they would draw more documents than the generator makes in minutes."""
    wl = settings.workload
    if wl.trace:
        return [wl]
    check_generation(wl, len(seeds))
    return [dataclasses.replace(wl, seed=seed) for seed in seeds]


def run_ablation(settings: Settings, seeds: list[int], progress: bool = True) -> tuple[list[dict], dict]:
    """The ablation of `settings` (prepared) over workload `seeds`: rows per (seed, step, mode)
    and the summary (experiments.common.results)."""
    cluster, wl = settings.cluster, settings.workload
    cost = cost_model(settings)
    seeds = [w.seed for w in seed_workloads(settings, seeds)]
    rows, selected, others = [], {}, {}
    workers = min(len(seeds), os.cpu_count() or 1)
    if workers > 1:  # the seeds are independent: one process each, as many at once as there are cores (forked, so
        # sparse kinds registered at run time come along); rows in seed order, as one process writes them
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            done = pool.map(_seed_rows, [(settings, seed, False) for seed in seeds])
            for seed, (seed_rows, chosen, rest) in tqdm(
                zip(seeds, done), total=len(seeds), desc="seeds", disable=not progress, file=sys.stderr
            ):
                rows += seed_rows
                selected[str(seed)], others[str(seed)] = chosen, rest
    else:
        for seed in seeds:
            seed_rows, selected[str(seed)], others[str(seed)] = _seed_rows((settings, seed, progress))
            rows += seed_rows
    per_seed, over_seeds = summarize_seeds(rows) if rows else ({}, {})
    summary = {
        "engine": "sim",
        "provenance": provenance(),
        "config": {
            **settings.to_dict(),
            "plugins": list(settings.plugins),  # the --plugin modules the run imported (its kinds' code)
            "fill": wl.tokens_per_step / (cluster.world_size * cluster.tokens_per_rank),
            "seeds": seeds,
            "group_rate_ratios": group_rate_ratios(cost, cluster),
        },
        "selected_steps": selected,
        "modes": summarize(rows) if rows else {},
        "seeds": per_seed,
        "over_seeds": over_seeds,
        "folding_saving_pct": folding_saving(per_seed),
        "paper": PAPER,
    }
    if any(others.values()):
        summary["whole_run"] = whole_run(rows, others)
    return rows, summary


def whole_run(rows: list[dict], others: dict) -> dict:
    """Each mode's change of the whole run's time vs baseline, per seed and over seeds: its
    selected steps' seconds (the rows) plus its seconds over every other step (--whole-run),
    against the baseline's same sum; every step of the run in the denominator."""
    per_seed = {}
    for seed, rest in others.items():
        mine = [r for r in rows if str(r["seed"]) == seed]
        total = {m: rest["seconds"][m] + sum(r["step_time_s"] for r in mine if r["mode"] == m) for m in rest["seconds"]}
        per_seed[seed] = {m: 100 * (t / total[REFERENCE] - 1) for m, t in total.items()}
    over = {}
    for m in next(iter(per_seed.values())):
        vals = [v[m] for v in per_seed.values()]
        over[m] = {"mean": float(np.mean(vals)), "min": float(np.min(vals)), "max": float(np.max(vals))}
    return {"steps": {s: r["steps"] for s, r in others.items()}, "per_seed": per_seed, "over_seeds": over}


def ablation_modes(cost: CostModel) -> list[str]:
    """Every mode the model's sparse kind can run (solver.modes.modes_for)."""
    return modes_for(cost.sparse)


def folding_pair() -> tuple[str, str] | None:
    """(the folded mode, its twin with a redistribution pass of its own): the first declared mode
    that redistributes, and the mode of the same stages that folds (repack+solver, redistribute)."""
    for m in MODE_TABLE:
        folded = None if m.folded else twin(m.name, folded=True)
        if folded:
            return folded, m.name
    return None


def control_pair() -> tuple[str, str] | None:
    """(the paper's solver mode, its control): the first mode that repacks into Ulysses children
    with the parent solver alone, and its twin without repacking (repack+solver, baseline+solver)."""
    for m in MODE_TABLE:
        if m.start == CHILDREN and m.solver and not (m.widths or m.cheapest) and m.folded:
            control = twin(m.name, start=OWN)
            if control:
                return m.name, control
    return None


def folding_saving(per_seed: dict) -> dict | None:
    """What folding the layout change into the full layers' all-to-alls saves (folding_pair): per
    seed, the mean step time of the redistributing mode (the same plans with a redistribution pass
    of their own) over that of the folded one, less 1, in percent of the redistributing one's; its
    mean, min and max over seeds, and the two modes' names (what the report says it compares)."""
    pair = folding_pair()
    if pair is None:
        return None
    folded, redist = pair
    vals = [
        100 * (1 - v[folded]["mean_step_time_s"] / v[redist]["mean_step_time_s"]) for v in per_seed.values() if redist in v and folded in v
    ]
    if not vals:
        return None
    return {"mean": float(np.mean(vals)), "min": float(np.min(vals)), "max": float(np.max(vals)), "folded": folded, "redistributed": redist}


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


def _fastest_ways(rows: list[dict], chooser: str) -> str:
    """How often the choosing mode's step is no slower than the fastest mode without a choice, and
    each of those modes' share of the steps where it is the fastest (ties: the first in the
    mode table), over the steps every mode ran."""
    steps: dict = {}
    for r in rows:
        steps.setdefault((r["seed"], r["step"]), {})[r["mode"]] = r["step_time_s"]
    singles = [m.name for m in MODE_TABLE if not m.cheapest]
    wins: dict[str, int] = {}
    no_slower = total = 0
    for times in steps.values():
        ran = [m for m in singles if m in times]
        if chooser not in times or not ran:
            continue
        best = min(ran, key=times.get)
        wins[best] = wins.get(best, 0) + 1
        no_slower += times[chooser] <= times[best]
        total += 1
    shares = ", ".join(f"{m} {100 * wins[m] / total:.0f}%" for m in singles if m in wins)
    return f"no slower on {no_slower} of {total} steps; the fastest way without it: {shares}"


def print_tables(rows, summary, out=None):
    p = lambda *a: print(*a, file=out or sys.stdout)
    cfg = summary["config"]
    cl, hw, tr = cfg["cluster"], cfg["hardware"], cfg["costs"]
    seeds = cfg["seeds"]
    n_selected = {s: len(v) for s, v in summary["selected_steps"].items()}
    p(
        f"\ncluster {cl['world_size']} ranks ({cl['gpus_per_node']}/node, {cl['tokens_per_rank']} tokens/rank), fill "
        f"{cfg['fill']:.2f}, model {cfg['model']['name']} ({cfg['model']['sparse_kind']} {cfg['model']['sparse_params']}), "
        f"assignment pricing {cfg['planner']['assignment_pricing']}"
    )
    wl = cfg["workload"]
    if wl.get("trace"):
        source = f"the steps of the trace {wl['trace']}"
    elif wl.get("lengths"):
        source = f"documents drawn from {describe(wl['lengths'])}"
    else:
        source = "documents drawn from the synthetic mixture (a log-normal body, rare long documents)"
    p(f"workload {wl['name']}: {source}" + (", clipped to the widest group" if wl.get("clip_to_cluster") else ""))
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in cfg["group_rate_ratios"].items())
    crossing = f", +{1e6 * hw['a2a_inter_latency']:.0f} us per call across nodes" if hw.get("a2a_inter_latency") else ""
    p(f"inter/intra ratio {hw['inter_intra_ratio']} read per {hw['ratio_reading']}: group all-to-all rates {ratios}{crossing}")
    halo = f"{1e6 * HardwareConfig.from_dict(hw).halo_call_latency:.0f} us"  # the simulator's rule for an unset one
    if hw.get("halo_latency") is None:
        halo += " (halo_latency unset: an all-to-all call's)"
    peer = f" (+{1e6 * hw['a2a_peer_latency']:.0f} us per peer past the first)" if hw.get("a2a_peer_latency") else ""
    p(
        f"fixed costs: an all-to-all call {1e6 * hw['a2a_latency']:.0f} us{peer}, a halo call {halo}, a collective "
        f"{1e6 * hw['collective_latency']:.0f} us, a layer {1e6 * hw['layer_overhead']:.0f} us per pass (their sources: --help)"
    )
    if hw.get("floored"):
        p(
            f"note: the calibration fitted {', '.join(hw['floored'])} at the floor of its range (0): the runtime's step took no "
            f"longer than its price without it, so it is priced free here (a bound, not a measurement)"
        )
    experts = f"EP{tr['ep_degree']} {tr['ep_placement']}-node, {100 * tr['moe_overlap']:.0f}% hidden" if tr["moe_all_to_all"] else "off"
    grad = f"{100 * tr['grad_sync_overlap']:.0f}% hidden" if tr["grad_sync"] else "off"
    p(
        f"costs every mode pays: recompute {tr['recompute']}, experts' all-to-all {experts}, gradient sync {grad}, "
        f"optimizer {'on' if tr['optimizer'] else 'off'}, router statistics "
        f"{'a world barrier per MoE layer' if tr.get('router_sync', False) else 'off'}"
    )
    if tr.get("overlap_blocks", 1) > 1:
        p(
            f"exchanges pipelined with attention in {tr['overlap_blocks']} head blocks, every mode alike (--overlap-blocks): a "
            f"priced what-if, the runtime does not pipeline"
        )
    p(
        f"seeds {seeds}: {sum(n_selected.values())} selected steps with SP16/32 parents "
        f"({', '.join(str(n) for n in n_selected.values())} of {cfg['workload']['steps']} per seed; the paper: 22 of 200)"
    )
    if not rows:
        p("no step needs a parent wider than a node: nothing to compare (try more steps or --long-prob)")
        return
    over, modes, paper = summary["over_seeds"], summary["modes"], summary["paper"]
    p("\nchange vs baseline: mean over seeds [min, max]                                     | the paper")
    head = f"{'step time %':>24} {'MFU pp':>24} {'MFU pp (non-causal)':>24} {'gain captured %':>22}"
    p(f"{'mode':>15} | {head} | {'time %':>7} {'MFU pp':>7}")
    for m in (m for m in MODES if m in over):
        e = over.get(m)
        pap = paper.get(m)
        pap_s = f"{pap['time_change_pct']:+7.2f} {pap['mfu_change_pp']:+7.2f}" if pap else f"{'-':>7} {'-':>7}"
        p(
            f"{m:>15} | {_range(e, 'time_change_pct'):>24} {_range(e, 'mfu_change_pp'):>24} {_range(e, 'mfu_noncausal_change_pp'):>24} "
            f"{_range(e, 'captured_gain_frac', 100, '.1f'):>22} | {pap_s}"
        )
    if "whole_run" in summary:
        w = summary["whole_run"]
        steps = ", ".join(str(n) for n in w["steps"].values())
        p(f"\nthe whole run ({steps} steps per seed, every one planned in every mode): step time vs baseline, mean [min, max] over seeds")
        for m, r in w["over_seeds"].items():
            if m != REFERENCE:
                p(f"  {m:>15}  {r['mean']:+.2f}% [{r['min']:+.2f}, {r['max']:+.2f}]")
    b = over[REFERENCE]
    p(
        f"\nbaseline MFU: ours {_range(b, 'mean_mfu', 100, '.1f')} % (causal), {_range(b, 'mean_mfu_noncausal', 100, '.1f')} % "
        f"(non-causal); the paper ~{paper['derived_baseline_mfu_pct']:.0f}% (derived, convention not given)"
    )
    pair = control_pair()
    if pair and all(m in modes for m in pair):
        solved, control = pair
        rs, bs = modes[solved]["time_change_pct"], modes[control]["time_change_pct"]
        mine = [r for r in rows if r["mode"] == solved]
        wide, repacked = sum(r["wide_parents"] for r in mine), sum(r["repacked_parents"] for r in mine)
        p(
            f"attribution (all selected steps pooled): {solved} {rs:+.2f}%, of which the parent solver alone ({control}) "
            f"{bs:+.2f}%; {solved} repacks {repacked} of its {wide} wide parents"
        )
    fold = summary.get("folding_saving_pct")
    if fold:
        p(
            f"folding the layout change into the full layers' all-to-alls ({fold['folded']}) instead of a redistribution pass of its own "
            f"({fold['redistributed']}) saves {_range({'f': fold}, 'f', fmt='.2f')}% of the step time (mean over seeds [min, max])"
        )
    for chooser in (m.name for m in MODE_TABLE if m.cheapest and m.name in modes):
        ch = [r for r in rows if r["mode"] == chooser]
        keys = ("wide_parents", "repacked_parents", "halo_parents", "halo_across_parents")
        wide, rep, halo, across = (sum(r[k] for r in ch) for k in keys)
        p(
            f"{chooser}: of its {wide} wide parents, {rep} take new children and {wide - rep} keep the parent's layout; "
            f"{halo} run sparse attention by halo exchange, {across} of them with a halo child across nodes"
        )
        p(f"{chooser} against the fastest way without a choice, step by step: {_fastest_ways(rows, chooser)}")
    halo_off = [m.name for m in MODE_TABLE if m.needs_reach and m.name not in modes]
    if halo_off:
        p(f"{', '.join(halo_off)}: not run, the sparse kind {cfg['model']['sparse_kind']!r} declares no reach (halo children need one)")
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
    for m in (m for m in MODES if m in modes):
        e = modes[m]
        p(f"{m:>15} " + " ".join(f"{e['mean_' + k]:12.3f}" for _, k in cols) + f" {e['mean_step_time_s']:8.3f}")
