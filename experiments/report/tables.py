"""The docs' tables, rendered from results/ (and from the config tree): each renderer returns the
markdown of one block and the provenance of what it read. experiments.report puts them into the
marked blocks of docs/*.md."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from collections.abc import Callable

import numpy as np

import config
from config import Section
from config.base import flag_of, profile_section
from experiments.common.errors import InputError
from experiments.common.gpu_pieces import PIECES
from experiments.common.memory import GIB, estimate
from experiments.common.results import GAP_PARTS, PAPER, exchanges_paid, gap_by_part, paired_steps, read_ablation, rest_paid
from experiments.common.settings import cost_model, default_settings
from solver.modes import CHILDREN, HALO_CHILDREN, MODE_TABLE, MODES, OWN, OWN_HALO, REFERENCE, mode_of, modes_where

COMPARED = [m for m in MODE_TABLE if m.name != REFERENCE]  # every mode but the one the changes are against
SINGLE_WAYS = modes_where(solver=False, cheapest=False)  # one mode per way a wide parent starts (no solver)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _range(e: dict | None, scale: float = 1.0, fmt: str = "+.1f", unit: str = "") -> str:
    if not e:
        return "n/a"
    return f"{scale * e['mean']:{fmt}}{unit} [{scale * e['min']:{fmt}}, {scale * e['max']:{fmt}}]"


def _read(folder: str) -> tuple[list[dict], dict]:
    return read_ablation(folder)


def run_provenance(summary: dict, where: str) -> dict:
    p = dict(summary.get("provenance") or {})
    p["where"] = where
    return p


def csv_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise InputError(f"{path!r} holds no rows")
    return rows


def csv_provenance(rows: list[dict], where: str) -> dict:
    first = rows[0]
    return {k: first.get(k, "") for k in ("command", "commit", "tree", "device", "time_utc")} | {"where": where}


# ----- the ablation -------------------------------------------------------------------------------------
def ablation(folder: str) -> tuple[str, list[dict]]:
    """Each mode's change vs baseline (mean over seeds [min, max]) next to the paper's."""
    rows, s = _read(folder)
    over, cfg = s["over_seeds"], s["config"]
    n = {k: len(v) for k, v in s["selected_steps"].items()}
    whole = s.get("whole_run", {}).get("over_seeds")  # absent from a run with --no-whole-run
    out = [
        [
            f"**{m.shown}**" if m.in_paper else m.shown,
            _range(over[m.name]["time_change_pct"], fmt="+.1f", unit="%"),
            _range(over[m.name]["mfu_change_pp"], fmt="+.1f", unit=" pp"),
            _range(over[m.name]["mfu_noncausal_change_pp"], fmt="+.1f", unit=" pp"),
            *([_range(whole[m.name], fmt="+.1f", unit="%")] if whole else []),
        ]
        for m in COMPARED
        if m.name in over
    ]
    for m in (m for m in COMPARED if m.in_paper):
        given = [f"{m.paper[0]:+.2f}%", f"{m.paper[1]:+.2f} pp", "(not given)"]
        out.append([f"the paper: {m.name}", *given, *(["(not given)"] if whole else [])])
    base = over[REFERENCE]
    head = ["mode", "step time vs baseline", "MFU (causal)", "MFU (non-causal)"]
    text = table(head + (["the whole run's time vs baseline (every step)"] if whole else []), out)
    text += (
        f"\n\nBaseline MFU: {_range(base['mean_mfu'], 100, '.1f', '%')} (causal), "
        f"{_range(base['mean_mfu_noncausal'], 100, '.1f', '%')} (non-causal); the paper's ~{PAPER['derived_baseline_mfu_pct']:.0f}% "
        f"(derived, convention not given). Seeds {cfg['seeds']}: {sum(n.values())} selected steps with parents wider than a "
        f"node ({', '.join(map(str, n.values()))} of {cfg['workload']['steps']} per seed; the paper: 22 of 200). Every figure is "
        f"the mean over seeds of the change of the mean step time over that seed's selected steps, with its [min, max] over seeds."
    )
    fold = s.get("folding_saving_pct")
    if fold:
        text += (
            f" Folding the layout change into the full layers' all-to-alls ({fold['folded']}) instead of a redistribution pass of "
            f"its own ({fold['redistributed']}, the same plans) saves {_range(fold, fmt='.1f', unit='%')} of the step time."
        )
    return text, [run_provenance(s, folder)]


def headline(folder: str) -> tuple[str, list[dict]]:
    """The README's headline: the paper's modes and the ones beyond it, ours next to the paper's."""
    _, s = _read(folder)
    over = s["over_seeds"]
    out = []
    for m in modes_where(headline=True):
        if m not in over:
            continue
        paper = mode_of(m).paper
        theirs = f"{paper[0]:+.2f}%, {paper[1]:+.2f} pp" if paper else "(not in the paper)"
        ours = f"{over[m]['time_change_pct']['mean']:+.1f}%, {over[m]['mfu_change_pp']['mean']:+.1f} pp"
        whole = [f"{s['whole_run']['over_seeds'][m]['mean']:+.1f}%"] if "whole_run" in s else []  # ablation --whole-run
        out.append([mode_of(m).shown, ours, *whole, theirs])
    seeds = len(over[REFERENCE]["seeds"])
    counts = ", ".join(str(len(v)) for v in s["selected_steps"].values())
    ours = (
        f"ours: step time, MFU vs baseline over the steps with SP16/32 parents ({counts} of {s['config']['workload']['steps']} "
        f"steps, per seed; mean over {seeds} seed{'s' if seeds > 1 else ''})"
    )
    whole = (
        [f"ours: step time vs baseline over the whole run (every step of {s['config']['workload']['steps']})"] if "whole_run" in s else []
    )
    text = table(["mode", ours, *whole, "the paper (its 22 such steps of 200)"], out)
    return text, [run_provenance(s, folder)]


def advise(folder: str) -> tuple[str, list[dict]]:
    """The decision (python -m experiments.advise): each candidate's whole-run and selected steps'
    change, its planning time against the baseline planner's and the pieces that never ran on a
    GPU; then each mode's whole-run change at the other ratios and fills."""
    path = os.path.join(folder, "advise.json")
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    with open(path) as f:
        r = json.load(f)
    cfg, modes = r["config"], r["modes"]
    rows = []
    for m, e in modes.items():
        mark = " (recommended)" if m == r["recommended"] else (" (runner-up)" if m == r["runner_up"] and r["pays"] else "")
        rows.append([
            f"{mode_of(m).shown}{mark}", _range(e["whole_run_pct"], unit="%"), _range(e["selected_steps_pct"], unit="%"),
            f"{e['plan_ms_per_step']:.1f} ms ({e['plan_vs_baseline']:.1f}x)", ", ".join(e["gpu_never"]) or "none",
        ])  # fmt: skip
    wide = sum(len(v) for v in r["selected_steps"].values())
    steps = sum(r["steps"].values())
    head = ["mode", "whole run vs baseline", "steps with SP16/32 parents", "planning a step (x baseline)", "never ran on a GPU"]
    text = table(head, rows)
    verdict = (
        f"Recommended: {r['recommended']}, runner-up {r['runner_up']}"
        if r["pays"]
        else f"No mode saves {r['min_gain_pct']:g}% of the whole run on every seed: run the baseline"
    )
    text += (
        f"\n\n{verdict}. {cfg['model']['name']} on {cfg['cluster']['world_size']} ranks ({cfg['cluster']['gpus_per_node']} a node), "
        f"seeds {r['seeds']}: {wide} of {steps} steps have parents wider than a node. Changes: mean over seeds [min, max]."
    )
    sens = r["sensitivity"]
    head = ["mode"] + [f"{p['factor']} {p['value']:g}{' (its own)' if p.get('own') else ''}" for p in sens]
    srows = [[mode_of(m).shown] + [f"{p['whole_run'][m]:+.1f}%" for p in sens] for m in modes if m != REFERENCE]
    text += f"\n\nThe whole run vs baseline at other ratios and fills (seeds {r['sensitivity_seeds']}):\n\n" + table(head, srows)
    return text, [run_provenance(r, folder)]


def variant_label(cfg: dict) -> str:
    c = cfg["costs"]
    paid = c["recompute"] != "none" or c["moe_all_to_all"] or c["grad_sync"] or c["optimizer"] or c["router_sync"]
    return f"{cfg['planner']['assignment_pricing']} / {cfg['hardware']['ratio_reading']} / {'all' if paid else 'bare'}"


def ablation_variants(*folders: str) -> tuple[str, list[dict]]:
    """The ablation under each assignment pricing, ratio reading and accounting of the costs every
    mode pays: one row per (run, mode)."""
    out, prov = [], []
    for folder in folders:
        _, s = _read(folder)
        over, label = s["over_seeds"], variant_label(s["config"])
        for k, m in enumerate(m.name for m in COMPARED):
            if m not in over:
                continue
            base = _range(over[REFERENCE]["mean_mfu"], 100, ".1f", "%") if k == 0 else ""
            out.append(
                [
                    label if k == 0 else "",
                    m,
                    _range(over[m]["time_change_pct"], unit="%"),
                    _range(over[m]["mfu_change_pp"], unit=" pp"),
                    base,
                ]
            )
        prov.append(run_provenance(s, folder))
    header = ["assignment pricing / ratio reading / costs", "mode", "step time vs baseline", "MFU (causal)", "baseline MFU"]
    return table(header, out), prov


def _run_labels(runs: list[dict]) -> list[str]:
    """Each run's label among `runs`: what tells it from the others (its workload's name, its
    model's), or its workload's name where nothing does."""
    keys = (("workload", "name"), ("model", "name"))
    differ = [k for k in keys if len({s["config"][k[0]][k[1]] for s in runs}) > 1] or [keys[0]]
    return [", ".join(str(s["config"][a][b]) for a, b in differ) for s in runs]


def workloads(*folders: str) -> tuple[str, list[dict]]:
    """The same ablation on each run's workload or model, side by side: per mode, the change of
    step time and of MFU vs baseline (mean over seeds [min, max]); under each run, the steps with
    a parent wider than a node per seed and the baseline's MFU."""
    runs = [_read(folder)[1] for folder in folders]
    header = ["mode"] + [f"{label}: step time, MFU vs baseline" for label in _run_labels(runs)]
    out = [[m.name] + [f"{_range(s['over_seeds'][m.name]['time_change_pct'], unit='%')}, "
                       f"{_range(s['over_seeds'][m.name]['mfu_change_pp'], unit=' pp')}" for s in runs]
           for m in COMPARED if all(m.name in s["over_seeds"] for s in runs)]  # fmt: skip
    out.append(["steps with SP16/32 parents, per seed"] + [
        f"{', '.join(str(len(v)) for v in s['selected_steps'].values())} of {s['config']['workload']['steps']}" for s in runs
    ])  # fmt: skip
    out.append(["baseline MFU (causal)"] + [_range(s["over_seeds"][REFERENCE]["mean_mfu"], 100, ".1f", "%") for s in runs])
    return table(header, out), [run_provenance(s, folder) for s, folder in zip(runs, folders)]


BREAKDOWN_COLUMNS = (
    ("compute", "compute_s"),
    ("intra-node exchanges", "intra_comm_s"),
    ("inter-node exchanges", "inter_comm_s"),
    ("experts' all-to-all", "moe_comm_s"),
    ("gradient sync", "grad_sync_s"),
    ("optimizer", "optimizer_s"),
    ("imbalance wait", "imbalance_wait_s"),
)


def breakdown(folder: str) -> tuple[str, list[dict]]:
    """Where a step's time goes, seconds per rank, mean over every selected step."""
    _, s = _read(folder)
    modes = s["modes"]
    out = [
        [m, *(f"{modes[m]['mean_' + k]:.3f}" for _, k in BREAKDOWN_COLUMNS), f"{modes[m]['mean_step_time_s']:.3f}"]
        for m in MODES
        if m in modes
    ]
    return table(["mode", *(n for n, _ in BREAKDOWN_COLUMNS), "step"], out), [run_provenance(s, folder)]


# ----- the sweep --------------------------------------------------------------------------------------
def sweep(path: str) -> tuple[str, list[dict]]:
    """Per factor and value: repack / repack+solver / baseline+solver / repack+widths, mean over
    seeds [min, max] (the compute pricing, the group reading unless named)."""
    rows = csv_rows(path)
    shown = tuple(m for m in modes_where(needs_reach=False, cheapest=False, folded=True) if m != REFERENCE)  # Ulysses layouts
    out = []
    for (factor, pricing, reading), values in sorted(_sweep_cells(rows).items()):
        label = f"{factor}, {pricing} pricing" + (f", {reading} reading" if reading else "")
        parts = []
        for v in _values(values):
            means = [_cell(values[(v, m)]) for m in shown if values.get((v, m))]
            parts.append(f"{_shown(v)}: " + " / ".join(means))
        out.append([label, "; ".join(parts)])
    text = table(["factor", "value: " + " / ".join(shown) + " (% step time vs baseline)"], out)
    return text, [csv_provenance(rows, path)]


# every mode that repacks or runs halos, grouped by the parents they share: the assigned parents (repack,
# halo, parent+halo), the parent solver's (repack+solver, redistribute), the width search's
# (repack+widths, choose); each group in the table's order
STRATEGIES = tuple(m.name for m in sorted((m for m in MODE_TABLE if m.start != OWN), key=lambda m: (m.solver, m.widths)))


def sweep_strategies(path: str) -> tuple[str, list[dict]]:
    """The ways to run the sparse layers at every point of the sweep (the compute pricing, each
    ratio reading at the ratio's points), the one with the lowest mean step time, and the fastest
    single way (every parent run alike: not choose)."""
    rows = csv_rows(path)
    out = []
    for (factor, pricing, reading), values in sorted(_sweep_cells(rows).items()):
        if pricing != "compute":
            continue
        for v in _values(values):
            means = {m: np.mean(values[(v, m)]) for m in STRATEGIES if values.get((v, m))}
            if not means:
                continue
            label = f"{factor} = {_shown(v)}" + (f" ({reading} reading)" if reading else "")
            single = {m: t for m, t in means.items() if not mode_of(m).cheapest}  # every parent run alike
            cells = (_cell(values[(v, m)]) if (v, m) in values else "" for m in STRATEGIES)
            out.append([label, *cells, min(means, key=means.get), min(single, key=single.get)])
    text = table(["point", *STRATEGIES, "fastest", "fastest single way"], out) + "\n\n% step time vs baseline, mean over seeds [min, max]."
    return text, [csv_provenance(rows, path)]


def _value(v: str):
    try:
        return float(v)
    except ValueError:
        return v


def _shown(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _values(values: dict) -> list:
    return sorted({v for v, _ in values}, key=lambda v: (isinstance(v, str), v))


def _cell(got: list[float]) -> str:
    return f"{np.mean(got):+.1f} [{np.min(got):+.1f}, {np.max(got):+.1f}]" if len(got) > 1 else f"{got[0]:+.1f}"


def _sweep_cells(rows: list[dict]) -> dict[tuple, dict[tuple, list[float]]]:
    """(factor, pricing, reading at the ratio's points) -> (value, mode) -> the seeds' changes."""
    cells: dict[tuple, dict[tuple, list[float]]] = {}
    for r in rows:
        key = (r["factor"], r["assignment_pricing"], r["ratio_reading"] if r["factor"] == "ratio" else "")
        cells.setdefault(key, {}).setdefault((_value(r["value"]), r["mode"]), []).append(float(r["time_change_pct"]))
    return cells


# ----- benchmarks -------------------------------------------------------------------------------------
def solver_planning(path: str) -> tuple[str, list[dict]]:
    """Planning time of every mode per cluster size and fill: median ms (its ratio to the baseline
    planner's, step by step: the median over the steps), and the simulator's own time per step on
    the reference's plans."""
    rows = csv_rows(path)
    fill_of = lambda r: float(r.get("fill") or 0.5)  # noqa: E731  (a bench of one fill, before the fills were a column)
    points = sorted({(fill_of(r), int(r["ranks"])) for r in rows})
    by = {(fill_of(r), int(r["ranks"]), r["mode"]): r for r in rows}
    out = []
    for fill, w in points:
        cells = []
        for m in MODES:
            r = by.get((fill, w, m))
            if r is None:
                cells.append("")
                continue
            ratio = f" ({float(r['vs_baseline']):.2f}x)" if r.get("vs_baseline") and m != REFERENCE else ""
            ms = float(r["median_ms"])
            cells.append(f"{ms:.{1 if ms < 100 else 0}f}{ratio}" + (" (one step)" if int(r["steps"]) == 1 and m == REFERENCE else ""))
        sim = by.get((fill, w, REFERENCE), {}).get("simulate_ms")
        out.append([w, f"{fill:g}", *cells, f"{float(sim):.0f}" if sim else ""])
    return table(["ranks", "fill", *MODES, "simulator"], out), [csv_provenance(rows, path)]


def solver_joint(path: str) -> tuple[str, list[dict]]:
    """Every mode's step estimate against the exact joint optimum on small instances."""
    rows = csv_rows(path)
    base = np.array([float(r["baseline_s"]) for r in rows])
    opt = np.array([float(r["optimum_s"]) for r in rows])
    proven = sum(r["optimum_proven"] == "True" for r in rows)
    out = []
    for m in (m for m in MODES if f"{m}_s" in rows[0]):
        t = np.array([float(r[f"{m}_s"]) for r in rows])
        gap = t / opt - 1
        total = float((base - opt).sum())
        captured = 100 * float((base - t).sum()) / total if total > 0 else float("nan")
        q = np.quantile(gap, [0.5, 0.95, 1.0]) * 100
        out.append([m, f"{captured:.1f}%", f"{100 * np.mean(gap <= 0.05):.0f}%", f"{q[0]:.2f}% / {q[1]:.1f}% / {q[2]:.1f}%"])
    text = table(["mode", "share of the baseline-to-optimum gap captured", "within 5% of the optimum", "gap median / p95 / max"], out)
    text += f"\n\n{len(rows)} instances, {proven} proven optimal."
    return text, [csv_provenance(rows, path)]


def host_bench(path: str) -> tuple[str, list[dict]]:
    rows = csv_rows(path)
    out = [
        [r["ranks"], r["mode"], f"SP{r['widest_parent']}", f"{r['halo_ranks']} of {r['timed_ranks']}"]
        + [f"{float(r['median_ms']):.1f}", f"{float(r['worst_ms']):.1f}"]
        for r in rows
    ]
    head = ["ranks", "mode", "widest parent", "timed ranks in halo children", "median ms", "worst rank ms"]
    return table(head, out), [csv_provenance(rows, path)]


def _where(path: str) -> str:
    return "emulated cluster" if "emulated" in path else "local gloo"


def _ranks_table(paths: tuple[str, ...], header: list[str], cells) -> tuple[str, list[dict]]:
    """A table of every row of each results CSV of a benchmark on ranks: where they ran, their
    number and per node, then cells(row) under `header`; with each file's provenance."""
    out, prov = [], []
    for path in paths:
        rows = csv_rows(path)
        out += [[_where(path), r["world"], r["gpus_per_node"], *cells(r)] for r in rows]
        prov.append(csv_provenance(rows, path))
    return table(["where", "ranks", "per node", *header], out), prov


def groups_bench(*paths: str) -> tuple[str, list[dict]]:
    """The exchanges' process groups per rank and the time to make them, eager against lazy, for
    each results file (local gloo ranks, the emulated cluster)."""
    header = [
        "groups made",
        "new_group calls",
        "groups a rank holds",
        "seconds making them",
        "of which at the first step",
    ]
    return _ranks_table(
        paths,
        header,
        lambda r: [
            r["way"],
            r["new_group_calls"],
            f"{r['held_min']}-{r['held_max']}",
            f"{float(r['seconds_max']):.3f}",
            f"{float(r['first_step_seconds_max']):.3f}",
        ],
    )


def contention_bench(*paths: str) -> tuple[str, list[dict]]:
    """What a sample adds to the runtime's step when every rank, the first rank of each node or
    rank 0 alone loops over extra samples, for each results file (experiments.bench.contention)."""
    header = [
        "cores",
        "extra samples on",
        "ranks x samples",
        "step ms, one sample a rank",
        "ms the extra samples add",
        "ms per extra sample",
        "vs every rank",
    ]
    return _ranks_table(
        paths,
        header,
        lambda r: [
            r["cores"],
            r["way"],
            f"{r['loaded_ranks']} x {r['samples']}",
            f"{float(r['base_ms']):.1f}",
            f"{float(r['added_ms']):.1f}",
            f"{float(r['per_sample_ms']):.2f}",
            f"{float(r['vs_every_rank']):.2f}x",
        ],
    )


def groups_summary(*paths: str) -> tuple[str, list[dict]]:
    """The README's line per results file: at its widest world, the groups a rank holds and the
    time to make them, lazy against eager."""
    parts, prov = [], []
    for path in paths:
        rows = csv_rows(path)
        world = max(int(r["world"]) for r in rows)
        way = {r["way"].split(":")[0]: r for r in rows if int(r["world"]) == world}
        lazy, eager = way["lazy"], way["eager"]
        where = "emulated" if "emulated" in path else "local gloo"
        parts.append(
            f"{world} {where} ranks: a rank holds at most {lazy['held_max']} process groups, made as the steps first use them in "
            f"{float(lazy['seconds_max']):.2f} s over {lazy['steps']} steps (every aligned group up front: {eager['held_max']}, "
            f"{float(eager['seconds_max']):.2f} s)"
        )
        prov.append(csv_provenance(rows, path))
    return "; ".join(parts) + ".", prov


def kernel_static(path: str) -> tuple[str, list[dict]]:
    """What the pack kernels' machine code says about each GPU (experiments.bench.kernels)."""
    rows = csv_rows(path)
    out = [
        [
            f"{r['gpu']} ({r['arch']})",
            f"{r['op']} SP{r['group_size']}, {r['heads']} heads x {r['head_dim']} {r['dtype']}",
            r["registers"],
            r["spill_bytes"],
            f"{r['vector_bytes']} B",
            r["resident_warps"],
            f"{r['in_flight_kb_per_sm']} / {r['needed_kb_per_sm']}",
            f"{r['bound_gbps']} of {r['hbm_gbps']}",
        ]
        for r in rows
    ]
    header = ["GPU", "launch", "registers", "spilled bytes", "data access", "resident warps", "KB in flight per SM / needed", "bound GB/s"]
    return table(header, out), [csv_provenance(rows, path)]


def kernel_bench(path: str) -> tuple[str, list[dict]]:
    """The pack and unpack kernels' bandwidth measured on a GPU (experiments.bench.kernels, as
    python3 -m experiments.gpu_check runs it), each against a device copy of the same bytes."""
    rows = csv_rows(path)
    out = []
    for r in rows:
        copy = float(r["copy_gbps"])
        out.append(
            [
                r["tokens"], f"SP{r['group_size']}", r["op"], r["megabytes"], r["copy_gbps"],
                f"{r['triton_gbps']} ({float(r['triton_gbps']) / copy:.2f})", f"{r['torch_gbps']} ({float(r['torch_gbps']) / copy:.2f})",
            ]
        )  # fmt: skip
    header = ["tokens a rank", "group", "op", "MB moved", "device copy GB/s", "Triton GB/s (of copy)", "torch path GB/s (of copy)"]
    return table(header, out), [csv_provenance(rows, path)]


def sparse_layer_traffic(steps: int = 200, seed: int = 0) -> dict[str, dict[str, float]]:
    """Per way of running the sparse layers: the bytes the busiest rank of a wide parent sends in
    one sparse layer's forward as the simulator prices them (solver.simulator.sparse_layer_bytes:
    Ulysses, its heads' all-to-all, entry and exit; halo, keys and values), in all and across
    nodes, mean over the default workload's steps with a parent wider than a node (the paper
    preset on 64 ranks, 8 a node)."""
    from experiments.common.workload import generate_steps  # noqa: PLC0415
    from solver import make_plan, samples_from_lengths  # noqa: PLC0415
    from solver.simulator import sparse_layer_bytes  # noqa: PLC0415

    s = default_settings(**{"--steps": steps, "--seed": seed})
    cluster, cost = s.cluster, cost_model(s)
    acc: dict[str, list[tuple[float, float]]] = {}
    for lengths in generate_steps(s.workload):
        samples = samples_from_lengths(lengths)
        base = make_plan(samples, cluster, cost, REFERENCE)
        if base.widest_parent <= cluster.gpus_per_node:
            continue
        for mode in SINGLE_WAYS:  # each way a parent can start with, on the reference's parents
            plan = base if mode == REFERENCE else make_plan(samples, cluster, cost, mode)
            sent, across = sparse_layer_bytes(plan, cost)
            wide = np.zeros(len(sent), dtype=bool)  # the ranks the modes run differently: the wide parents'
            for p in plan.wide_parents():
                wide[p.group.start : p.group.stop] = True
            busiest = int(np.argmax(np.where(wide, sent, -1.0)))
            acc.setdefault(mode, []).append((float(sent[busiest]), float(across[busiest])))
    return {
        m: {"mb": float(np.mean([w[0] for w in v])) / 1e6, "across_mb": float(np.mean([w[1] for w in v])) / 1e6} for m, v in acc.items()
    }


def sparse_traffic() -> tuple[str, list[dict]]:
    """The busiest rank's bytes in one sparse layer, by the way the sparse layers run."""
    what = {
        OWN: "Ulysses in the parent ({}): heads, entry and exit",
        CHILDREN: "node-local Ulysses children ({}): heads, entry and exit",
        HALO_CHILDREN: "halo children ({}): keys and values to the ranks after",
        OWN_HALO: "the parent's layout with halos ({})",
    }
    got = sparse_layer_traffic()
    rows = [[what[mode_of(m).start].format(m), f"{e['mb']:.0f}", f"{e['across_mb']:.0f}"] for m, e in got.items()]
    text = table(["how the sparse layers run", "busiest rank, MB a layer", "of which across nodes"], rows)
    return text, [
        {"command": "python -m experiments.report", "where": "the default workload's steps with parents wider than a node (seed 0)"}
    ]


def gpu_pieces() -> tuple[str, list[dict]]:
    """What has run on a GPU, piece by piece (experiments.common.gpu_pieces), with the GPU tests
    that check each."""
    rows = [
        [n, p.what, "host only" if p.host else (p.ran or "**never**"), ", ".join(f"`{t.split('::')[1]}`" for t in p.tests) or "none"]
        for n, p in PIECES.items()
    ]
    text = table(["piece", "what it is", "run on a GPU", "its GPU tests (pytest -m gpu)"], rows)
    return text, [{"command": "python -m experiments.report", "where": "the table of GPU runs (experiments/common/gpu_pieces.py)"}]


# each shipped Hugging Face model's card: total and active parameters, in billions, as published
MODEL_CARDS = {"qwen3-next-80b-a3b": (80, 3), "kimi-linear-48b-a3b": (48, 3), "gpt-oss-120b": (117, 5.1)}


def hf_models() -> tuple[str, list[dict]]:
    """The shipped Hugging Face models (config/hf_models) as the cost model reads them: their layers,
    what it prices beyond attention and experts, and its parameter counts beside the model card's."""
    rows = []
    for name, (card_total, card_active) in MODEL_CARDS.items():
        cfg = config.ModelConfig.from_name(name)
        cost = cost_model(default_settings(name))
        rows.append(
            [
                f"`{name}` ({cfg.architecture})",
                f"{cfg.n_layers} ({cfg.n_full} full, {cfg.n_sparse} {cfg.sparse_kind})",
                cfg.describe().split(", ", 2)[2],
                f"{cost.total_params() / 1e9:.1f}B / {cost.active_params() / 1e9:.2f}B",
                f"{card_total:g}B / {card_active:g}B",
            ]
        )
    text = table(
        [
            "model",
            "layers",
            "shapes priced",
            "cost model: total / active parameters (active: a token's, the LM head in, the embedding out)",
            "model card",
        ],
        rows,
    )
    return text, [{"command": "python -m experiments.report", "where": "config/hf_models/*/config.json read by config.hf"}]


def memory() -> tuple[str, list[dict]]:
    """The memory estimate per rank (FSDP2 without and with expert parallelism, full recompute, bf16,
    16384 tokens per rank)."""
    worlds = (8, 16, 32, 64, 128)
    out = []
    for name in ("small", "paper"):
        s = default_settings(name)
        cfg, cost = s.model, cost_model(s)
        params, ep = cost.total_params(), cost.ep_degree  # EP8 for both: a node of 8, dividing the experts
        for label, e in (("FSDP2", 1), (f"FSDP2 + EP{ep}", ep)):
            sharded = [estimate(cfg, w, 16384, "fsdp", ep=e)["total"] / GIB for w in worlds]
            replicated = f"{estimate(cfg, 8, 16384, 'none')['total'] / GIB:.1f}" if e == 1 else ""
            out.append(
                [
                    f"`{name}`" if e == 1 else "",
                    f"{params / 1e9:.2f}B" if e == 1 else "",
                    label,
                    *(f"{g:.1f}" + (" (fits 80 GiB)" if g < 80 else "") for g in sharded),
                    replicated,
                ]
            )
    text = "GiB per rank:\n\n" + table(["model", "parameters", "sharding", *(f"{w} GPUs" for w in worlds), "replicated"], out)
    return text, [{"command": "python -m experiments.bench.memory", "where": "the model presets (an estimate from the shapes)"}]


# ----- the emulated cluster ---------------------------------------------------------------------------
def _pair(e: dict, key: str) -> str:
    """predicted / measured of one breakdown term ("n/a" in a comparison made before it was measured)."""
    if key not in e["predicted"] or key not in e["measured"]:
        return "n/a"
    return f"{e['predicted'][key]:.3f} / {e['measured'][key]:.3f}"


def _emulated_shape(result: dict) -> str:
    """An emulated comparison's cluster and model (compare.json), as the blocks say it."""
    c = result["cluster"]
    model = f", the {result['model']} model" if "model" in result else ""  # comparisons before --model ran the tiny model
    burst = f" (a {c.get('burst_kb', 256)} KB burst)"  # runs before --burst-kb had 256
    return f"{c['nodes']} emulated nodes x {c['ranks_per_node']} gloo ranks, {c['inter_mbit']:g} Mbit/s between nodes{burst}{model}"


def _per_peer(hw: dict) -> str:
    """What each peer past the first adds to an all-to-all call, where a calibration fitted it
    (profiles from before the setting carry none, and say nothing of it)."""
    peer = hw.get("a2a_peer_latency") or 0.0
    return f", +{1e3 * peer:.2f} ms per peer past the first" if peer else ""


def emulated(folder: str) -> tuple[str, list[dict]]:
    path = os.path.join(folder, "compare.json")
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    with open(path) as f:
        result = json.load(f)
    out = []
    for m, e in result["modes"].items():
        change = (
            ""
            if m == REFERENCE
            else f"{e['predicted_change_pct']:+.1f}% vs {e['measured_change_pct']:+.1f}% ({abs(e['change_gap_pp']):.1f} pp)"
        )
        out.append(
            [
                m,
                e["steps"],
                f"{e['median_abs_rel_error_pct']:.1f}% / {e['worst_abs_rel_error_pct']:.1f}%",
                change,
                "yes" if e["same_plans"] else "NO",
            ]
        )
    text = table(["mode", "steps", "step time error: median / worst", "change vs baseline: predicted vs measured (gap)", "same plans"], out)
    parts = result.get("breakdown", {})
    if parts:
        rows = [
            [
                m,
                f"{e['predicted']['exchange_full_s']:.3f} / {e['measured']['exchange_full_s']:.3f}",
                f"{e['predicted']['exchange_sparse_s']:.3f} / {e['measured']['exchange_sparse_s']:.3f}",
                _pair(e, "exchange_moe_s"),
                f"{e['predicted']['step_time_s']:.3f} / {e['measured']['step_time_s']:.3f}",
            ]
            for m, e in parts.items()
        ]
        text += "\n\nSeconds per step and rank, predicted / measured:\n\n" + table(
            ["mode", "full-layer exchanges", "sparse-layer exchanges", "experts' all-to-all", "step"], rows
        )
    text += f"\n\n{_emulated_shape(result)}."
    profile = os.path.join(folder, "calibrate", "profile.json")
    if os.path.exists(profile):  # the fixed costs and the ratio the predictions were priced with
        hw = profile_section(profile, "hardware")
        halo = hw.get("halo_latency")
        text += (
            f" Calibrated there: an all-to-all call costs {1e3 * hw['a2a_latency']:.1f} ms whatever its bytes{_per_peer(hw)}, a halo call "
            + (f"{1e3 * halo:.1f} ms" if halo is not None else "as much (halo_latency unset)")
            + f", and the inter/intra ratio is {hw['inter_intra_ratio']:.2f}x ({hw['ratio_reading']} reading)."
        )
    return text, [run_provenance(result, folder)]


def emulated_runs(*folders: str) -> tuple[str, list[dict]]:
    """Several emulated comparisons of one setting (emulated's folders): per mode each run's gap
    (predicted minus measured change vs baseline, in pp) and their median, and each run's median
    step-time error; under it, what each run's calibration fitted (the ratio, an all-to-all call's
    latency and what crossing nodes adds to it, a halo call's latency, a linear kind's per-block
    cost), the figures that move between runs."""
    runs = []
    for folder in folders:
        path = os.path.join(folder, "compare.json")
        if not os.path.exists(path):
            raise FileNotFoundError(path)
        with open(path) as f:
            runs.append(json.load(f))
    rows = []
    for mode in runs[0]["modes"]:
        if mode == REFERENCE:
            continue
        each = [r["modes"][mode] for r in runs if mode in r["modes"]]
        gaps = [e["change_gap_pp"] for e in each]
        rows.append(
            [
                mode,
                ", ".join(f"{e['predicted_change_pct']:+.1f}% vs {e['measured_change_pct']:+.1f}%" for e in each),
                ", ".join(f"{g:+.1f}" for g in gaps),
                f"{float(np.median(gaps)):+.1f} ({float(np.median(np.abs(gaps))):.1f})",
                ", ".join(f"{e['median_abs_rel_error_pct']:.0f}%" for e in each),
            ]
        )
    text = table(
        [
            "mode",
            "change vs baseline, predicted vs measured, each run",
            "gap (pp), each run",
            "median gap (median of its size)",
            "step time error, median, each run",
        ],
        rows,
    )
    text += f"\n\n{len(runs)} runs, {_emulated_shape(runs[0])}."
    fitted = []
    for k, folder in enumerate(folders, 1):
        profile = os.path.join(folder, "calibrate", "profile.json")
        if not os.path.exists(profile):
            continue
        hw = profile_section(profile, "hardware")
        halo = hw.get("halo_latency")
        block = hw.get("linear_block_latency") or 0.0
        sample = hw.get("attention_sample_latency") or 0.0
        fitted.append(
            f"run {k}: ratio {hw['inter_intra_ratio']:.2f}x ({hw['ratio_reading']}), all-to-all call {1e3 * hw['a2a_latency']:.1f} ms "
            f"(+{1e3 * hw['a2a_inter_latency']:.1f} ms across nodes{_per_peer(hw)}), "
            + (f"halo call {1e3 * halo:.1f} ms" if halo is not None else "halo call as an all-to-all's")
            + (f", {1e3 * block:.2f} ms per recurrence block" if block else "")
            + (f", {1e3 * sample:.2f} ms per attention sample" if sample and not block else "")
        )
    if fitted:
        text += " Calibrated in each run: " + "; ".join(fitted) + "."
    pairs = [paired_steps(os.path.join(f, "predicted"), os.path.join(f, "measured")) for f in folders]
    parts = [gap_by_part(p) for p in pairs]
    split = []
    for mode in parts[0]:
        each = [p[mode] for p in parts if mode in p]
        cells = (f"{float(np.median([e[k] for e in each])):+.1f} ({', '.join(f'{e[k]:+.1f}' for e in each)})" for k in GAP_PARTS)
        split.append([mode, *cells])
    text += (
        "\n\nEach gap by the part of the step it comes from (pp; a part's predicted change less its measured one, each over the "
        + ("baseline's step; negative: less gain measured than predicted), median (each run):\n\n")
        + table(["mode", "full-layer exchanges", "sparse-layer exchanges", "experts' all-to-all", "the rest of the step"], split)
    )

    def each_run(slope) -> str:
        return ", ".join(f"{v:.2f}" if np.isfinite(v) else "n/a" for v in map(slope, pairs))

    paid, moved = each_run(rest_paid), each_run(exchanges_paid)
    text += (
        "\n\nOf a predicted change in the rest of the step (between modes: the samples, or a linear kind's blocks, each rank "
        f"loops over, and the imbalance wait), the measured rest shows {paid} in each run (least-squares slope over the steps "
        f"and modes; 1: paid as priced); of a predicted change in the exchanges, the measured exchanges show {moved} (1: an "
        "exchange saved saves its price)."
    )
    return text, [run_provenance(r, f) for r, f in zip(runs, folders)]


# ----- the config tree ----------------------------------------------------------------------------------
def settings(*names: str) -> tuple[str, list[dict]]:
    """Every setting of the named sections: flag, default, what it is, where the default comes from."""
    by_name = {c.SECTION: c for c in vars(config).values() if isinstance(c, type) and issubclass(c, Section) and c is not Section}
    blocks = []
    for name in names:
        cls = by_name[name]
        rows = []
        for f in dataclasses.fields(cls):
            if not f.metadata.get("cli", True):
                continue
            default = getattr(cls(), f.name)
            shown = (
                " ".join(f"{k}={v}" for k, v in default.items()) if isinstance(default, dict) else ("unset" if default is None else default)
            )
            rows.append([f"`{flag_of(f)}`", f"`{shown}`", f.metadata["doc"], f.metadata.get("source") or ""])
        presets = f" Presets (`--{name} NAME`): {', '.join(f'`{p}`' for p in cls.PRESETS)}." if cls.PRESETS else ""
        head = f"**{name}** (`config.{cls.__name__}`).{presets}"
        blocks.append(head + "\n\n" + table(["flag", "default", "what it is", "source of the default"], rows))
    return "\n\n".join(blocks), [{"command": "python -m experiments.report", "where": "the config tree (config/)"}]


NAMED = {"settings"}  # renderers whose arguments are names (sections), not paths inside results/
RENDERERS: dict[str, Callable[..., tuple[str, list[dict]]]] = {
    "ablation": ablation,
    "headline": headline,
    "advise": advise,
    "ablation-variants": ablation_variants,
    "workloads": workloads,
    "models": workloads,  # the same table: runs that differ in their model
    "breakdown": breakdown,
    "sweep": sweep,
    "sweep-strategies": sweep_strategies,
    "solver-planning": solver_planning,
    "solver-joint": solver_joint,
    "host-bench": host_bench,
    "kernel-static": kernel_static,
    "kernel-bench": kernel_bench,
    "groups-bench": groups_bench,
    "contention-bench": contention_bench,
    "groups-summary": groups_summary,
    "memory": memory,
    "hf-models": hf_models,
    "gpu-pieces": gpu_pieces,
    "sparse-traffic": sparse_traffic,
    "emulated": emulated,
    "emulated-runs": emulated_runs,
    "settings": settings,
}
