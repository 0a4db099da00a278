"""The ablation's run, shared by the entry points that run it (experiments.ablation, its sweep,
experiments.advise) and the notebooks: select the steps with parents wider than a node, plan each
in every mode and simulate, and (whole run) plan and price every other step too; summarize over
seeds. A run is a list of SeedJob, one per (settings, seed), run on as many processes as there
are cores."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import numpy as np
from tqdm import tqdm

from config import Cluster, WorkloadConfig
from config.cli import Settings
from config.reads import data_source
from solver import CostModel, PlanError, make_plan, samples_from_lengths
from solver.modes import CHILDREN, MODE_TABLE, OWN, REFERENCE, modes_for, twin
from solver.simulator import simulate

from .provenance import provenance
from .results import PAPER, summarize, summarize_seeds
from .settings import cost_model
from .workload import check_generation, workload_steps


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


def simulate_row(row: dict, plan, cost: CostModel, result=None) -> dict:
    """`row` with the simulated step of `plan` (`result`, where already simulated)."""
    r = result if result is not None else simulate(plan, cost)
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


@dataclasses.dataclass(frozen=True)
class SeedJob:
    """One seed of one run: its prepared settings, the workload seed, the modes to run (every one
    the kind can run, where None) and whether every other step of the run is planned and priced too."""

    settings: Settings
    seed: int
    modes: tuple[str, ...] | None = None
    whole_run: bool = False


@dataclasses.dataclass
class SeedResult:
    """A SeedJob's result: a row per selected step and mode, the selected steps' numbers, and with
    the whole run each mode's seconds and planning seconds over the other steps, and their count."""

    rows: list[dict]
    selected: list[int]
    rest: dict


def seed_rows(job: SeedJob, progress: bool = False) -> SeedResult:
    """Run one SeedJob. A step's plans with the same layout (StepPlan.layout_hash) are simulated
    once: they run alike."""
    settings, seed = job.settings, job.seed
    cluster, wl, pricing = settings.cluster, settings.workload, settings.planner.assignment_pricing
    cost = cost_model(settings)
    modes = list(job.modes) if job.modes is not None else ablation_modes(cost)
    steps = workload_steps(dataclasses.replace(wl, seed=seed))
    chosen = select_wide_steps(steps, cluster, cost, progress, pricing, data_source(settings))
    rows = []
    for i in tqdm(chosen, desc=f"seed {seed}: {len(modes)} modes", disable=not progress, file=sys.stderr, leave=False):
        number, lengths = steps[i]
        simulated = {}
        for mode in modes:
            row, plan = plan_row(number, lengths, cluster, cost, mode, pricing=pricing)
            if plan.layout_hash not in simulated:
                simulated[plan.layout_hash] = simulate(plan, cost)
            rows.append({"seed": seed, **simulate_row(row, plan, cost, simulated[plan.layout_hash])})
    rest = {}
    if job.whole_run:
        others = [steps[i][1] for i in sorted(set(range(len(steps))) - set(chosen))]
        rest = {"steps": len(steps), "seconds": dict.fromkeys(modes, 0.0), "plan_s": dict.fromkeys(modes, 0.0)}
        for lengths in tqdm(others, desc=f"seed {seed}: the other steps", disable=not progress, file=sys.stderr, leave=False):
            simulated = {}
            for mode in modes:
                t0 = time.perf_counter()
                plan = make_plan(samples_from_lengths(lengths), cluster, cost, mode, pricing)
                rest["plan_s"][mode] += time.perf_counter() - t0
                if plan.layout_hash not in simulated:
                    simulated[plan.layout_hash] = simulate(plan, cost).step_time
                rest["seconds"][mode] += simulated[plan.layout_hash]
    return SeedResult(rows, [steps[i][0] for i in chosen], rest)


def run_jobs(jobs: list[SeedJob], progress: bool = True, desc: str = "seeds") -> list[SeedResult]:
    """Every job's result, in the jobs' order: one process per job, as many at once as there are
    cores (forked, so sparse kinds registered at run time come along); one job runs here, with its
    steps' progress."""
    workers = min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        return [seed_rows(j, progress) for j in jobs]
    out: list = [None] * len(jobs)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {pool.submit(seed_rows, j): k for k, j in enumerate(jobs)}
        for f in tqdm(as_completed(futures), total=len(jobs), desc=desc, disable=not progress, file=sys.stderr):
            out[futures[f]] = f.result()
    return out


def seed_workloads(settings: Settings, seeds: list[int]) -> list[WorkloadConfig]:
    """The workload of each seed the ablation runs (prepared settings): one for a trace, which is
    one fixed workload (config.reads refuses --seeds given with it); SettingError before any is
    drawn when they would draw more documents than the generator makes in minutes."""
    wl = settings.workload
    if wl.trace:
        return [wl]
    check_generation(wl, len(seeds))
    return [dataclasses.replace(wl, seed=seed) for seed in seeds]


def ablation_jobs(settings: Settings, seeds: list[int], modes=None, whole: bool | None = None) -> list[SeedJob]:
    """The jobs of one ablation: a SeedJob per seed of `settings` (prepared); `whole` the
    ablation section's whole_run where None."""
    if whole is None:
        whole = "ablation" in settings.sections and settings.ablation.whole_run
    modes = tuple(modes) if modes is not None else None
    return [SeedJob(settings, w.seed, modes, whole) for w in seed_workloads(settings, seeds)]


def run_ablation(settings: Settings, seeds: list[int], progress: bool = True, modes=None, whole: bool | None = None):
    """The ablation of `settings` (prepared) over workload `seeds`: rows per (seed, step, mode)
    and the summary (experiments.common.results)."""
    jobs = ablation_jobs(settings, seeds, modes, whole)
    return summarize_ablation(settings, jobs, run_jobs(jobs, progress))


def summarize_ablation(settings: Settings, jobs: list[SeedJob], results: list[SeedResult]) -> tuple[list[dict], dict]:
    """The rows and the summary of an ablation's jobs (one settings, a job per seed) and their results."""
    cluster, wl = settings.cluster, settings.workload
    cost = cost_model(settings)
    rows = [r for res in results for r in res.rows]
    selected = {str(j.seed): res.selected for j, res in zip(jobs, results)}
    others = {str(j.seed): res.rest for j, res in zip(jobs, results)}
    per_seed, over_seeds = summarize_seeds(rows) if rows else ({}, {})
    summary = {
        "engine": "sim",
        "provenance": provenance(),
        "config": {
            **settings.to_dict(),
            "plugins": list(settings.plugins),  # the --plugin modules the run imported (its kinds' code)
            "fill": wl.tokens_per_step / (cluster.world_size * cluster.tokens_per_rank),
            "seeds": [j.seed for j in jobs],
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
    against the baseline's same sum; every step of the run in the denominator. With it, each
    mode's planning time and simulated time per step over the whole run (means over seeds)."""
    per_seed, plan_ms, step_s = {}, {}, {}
    for seed, rest in others.items():
        mine = [r for r in rows if str(r["seed"]) == seed]
        total = {m: rest["seconds"][m] + sum(r["step_time_s"] for r in mine if r["mode"] == m) for m in rest["seconds"]}
        per_seed[seed] = {m: 100 * (t / total[REFERENCE] - 1) for m, t in total.items()}
        for m in rest["seconds"]:
            ms = 1e3 * rest["plan_s"][m] + sum(r["plan_ms"] for r in mine if r["mode"] == m)
            plan_ms.setdefault(m, []).append(ms / rest["steps"])
            step_s.setdefault(m, []).append(total[m] / rest["steps"])
    over = {}
    for m in next(iter(per_seed.values())):
        vals = [v[m] for v in per_seed.values()]
        over[m] = {"mean": float(np.mean(vals)), "min": float(np.min(vals)), "max": float(np.max(vals))}
    return {
        "steps": {s: r["steps"] for s, r in others.items()},
        "per_seed": per_seed,
        "over_seeds": over,
        "plan_ms_per_step": {m: float(np.mean(v)) for m, v in plan_ms.items()},
        "mean_step_s": {m: float(np.mean(v)) for m, v in step_s.items()},
    }


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
