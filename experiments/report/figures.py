"""The docs' figures, drawn with the notebooks' plots (experiments.report.plots) and written to
docs/figures/: each renderer returns the file and the provenance of what it drew."""

from __future__ import annotations

import os

from experiments.common.provenance import provenance
from experiments.common.settings import cost_model, default_settings
from experiments.common.workload import generate_steps
from experiments.report import plots
from experiments.report.tables import csv_provenance, csv_rows, run_provenance
from solver import make_plan, samples_from_lengths

plt = plots.plt


def _save(fig, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ablation(out_dir: str, folder: str) -> tuple[str, list[dict]]:
    """Each mode's change vs baseline next to the paper's, and where a step's time goes."""
    df, summary = plots.read_ablation(folder)
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2))
    plots.plot_mean_changes(summary, axes[:2])
    plots.plot_breakdown(summary, axes[2])
    n = sum(len(v) for v in summary["selected_steps"].values())
    fig.suptitle(f"Layerwise Repacking ablation, simulated ({n} steps over seeds {summary['config']['seeds']})")
    fig.tight_layout()
    return _save(fig, out_dir, "ablation"), [run_provenance(summary, folder)]


def layouts(out_dir: str) -> tuple[str, list[dict]]:
    """The parent and the child layout of a default step: the first step of the default workload
    (seed 0, 64 ranks in nodes of 8) whose repack plan repacks a parent wider than a node."""
    s, mode = default_settings(**{"--steps": 60}), "repack"
    cost = cost_model(s)
    for k, lengths in enumerate(generate_steps(s.workload)):  # noqa: B007 (k names the step below)
        plan = make_plan(samples_from_lengths(lengths), s.cluster, cost, mode)
        if any(p.repacked for p in plan.wide_parents()):
            break
    else:
        raise RuntimeError("no step of the default workload's first 60 repacks a wide parent")
    fig, axes = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    plots.plot_layouts(plan, axes)
    fig.suptitle(f"Step {k} of the default workload, {mode}: the parent layout (full attention) and the child layout (the rest)")
    fig.tight_layout()
    prov = {**provenance(), "command": "python -m experiments.report", "where": f"step {k} of the default workload ({mode})"}
    return _save(fig, out_dir, "layouts"), [prov]


def sweep(out_dir: str, path: str) -> tuple[str, list[dict]]:
    """The gain against the fill, the ratio and the window, per assignment pricing."""
    rows = csv_rows(path)
    axes = plots.plot_sweep(path)
    fig = axes.flat[0].figure
    fig.tight_layout()
    folder = os.path.basename(os.path.dirname(path)) or "sweep"  # results/sweep-gdn/sweep.csv: sweep-gdn.png
    return _save(fig, out_dir, folder), [csv_provenance(rows, path)]


FIGURES = {"ablation": ablation, "layouts": layouts, "sweep": sweep}


def render(name: str, paths: list[str], out_dir: str) -> tuple[str, list[dict]]:
    if name not in FIGURES:
        raise KeyError(f"no figure {name!r}; figures: {sorted(FIGURES)}")
    return FIGURES[name](out_dir, *paths)
