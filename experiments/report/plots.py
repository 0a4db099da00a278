"""Plots and loaders for the notebooks and the report (the notebooks stay thin: load results, call
these; python -m experiments.report renders the docs' figures with them)."""

from __future__ import annotations

import os
import subprocess
import sys

import matplotlib

matplotlib.use(os.environ.get("MPLBACKEND", "Agg"))
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from experiments.common.errors import InputError  # noqa: E402
from experiments.common.results import BREAKDOWN, PAPER, read_run  # noqa: E402
from experiments.common.results import read_ablation as read_ablation_run  # noqa: E402
from solver import CostModel, StepPlan, exchange_bytes, token_to_head_plan  # noqa: E402
from solver.modes import CHILDREN, HALO_CHILDREN, MODE_TABLE, MODES  # noqa: E402

RESULTS = os.environ.get("REPACK_RESULTS", "results")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


RUN_FILES = ("steps.csv", "summary.json")


def load_or_run_ablation(folder: str | None = None) -> tuple[pd.DataFrame, dict]:
    """The ablation's rows and summary; runs the ablation on its defaults into an empty or missing
    folder (python -m experiments.ablation). A folder that holds part of a run is never written
    over: InputError names what is missing."""
    folder = folder or os.path.join(RESULTS, "ablation")
    present = [f for f in RUN_FILES if os.path.exists(os.path.join(folder, f))]
    if present and len(present) < len(RUN_FILES):
        missing = sorted(set(RUN_FILES) - set(present))
        raise InputError(f"{folder!r} holds {present} but not {missing}: an incomplete run; move it aside or rerun the ablation there")
    if not present:
        print(f"no results in {folder}: running the ablation on its defaults", file=sys.stderr)
        cmd = [sys.executable, "-m", "experiments.ablation", "--out", os.path.abspath(folder), "--no-progress"]
        subprocess.run(cmd, check=True, cwd=ROOT)
    return read_ablation(folder)


def read_ablation(folder: str) -> tuple[pd.DataFrame, dict]:
    """An ablation's rows and summary (FileNotFoundError when it holds none; InputError, one line,
    for a training run's folder or an ablation that selected no step: experiments.common.results)."""
    rows, summary = read_ablation_run(folder)
    return pd.DataFrame(rows), summary


def load_measured(folder: str | None = None) -> tuple[pd.DataFrame, dict] | None:
    folder = folder or os.path.join(RESULTS, "train")
    if not os.path.exists(os.path.join(folder, "summary.json")):
        return None
    rows, summary = read_run(folder)
    return pd.DataFrame(rows), summary


def mode_means(df: pd.DataFrame, columns=("step_time_s", "mfu", "loss")) -> pd.DataFrame:
    """Each mode's mean of `columns`, a nan or inf in a column kept as such (pandas' own mean skips a
    nan: a diverged step would vanish from the mean loss)."""
    return df.groupby("mode")[list(columns)].agg(lambda s: s.mean(skipna=False))


def plot_step_times(df: pd.DataFrame, ax=None):
    ax = ax or plt.figure(figsize=(12, 4)).gca()
    d = df.assign(step_label=df["seed"].astype(str) + ":" + df["step"].astype(str))
    sns.barplot(data=d, x="step_label", y="step_time_s", hue="mode", hue_order=[m for m in MODES if m in set(df["mode"])], ax=ax)
    ax.set(title="Step time of each selected step by mode (simulated)", xlabel="seed:training step", ylabel="step time (s)")
    ax.tick_params(axis="x", rotation=90)
    return ax


def run_modes(summary: dict) -> list[str]:
    """The modes a run holds, in MODES' order (a sparse kind without a reach runs no halo modes)."""
    return [m for m in MODES if m in summary["modes"]]


def mean_changes(summary: dict) -> pd.DataFrame:
    """Each mode's change vs baseline: ours as the mean over seeds with its [min, max], the paper's where it has one."""
    recs = []
    for m in run_modes(summary)[1:]:
        e = summary["over_seeds"][m]
        for key, label in (("time_change_pct", "step time change (%)"), ("mfu_change_pp", "MFU change (pp)")):
            recs.append({"mode": m, "figure": label, "source": "ours", "mean": e[key]["mean"], "min": e[key]["min"], "max": e[key]["max"]})
            if m in PAPER:
                v = PAPER[m][key]
                recs.append({"mode": m, "figure": label, "source": "paper", "mean": v, "min": v, "max": v})
    return pd.DataFrame(recs)


def plot_mean_changes(summary: dict, axes=None):
    """Bars: ours (mean over seeds, whiskers: min and max over seeds) next to the paper's."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(14, 4.5), layout="constrained")
    d = mean_changes(summary)
    modes = run_modes(summary)[1:]
    for ax, figure in zip(axes, ("step time change (%)", "MFU change (pp)")):
        sub = d[d["figure"] == figure]
        for k, source in enumerate(("ours", "paper")):
            rows = sub[sub["source"] == source].set_index("mode").reindex(modes)
            x = np.arange(len(modes)) + (k - 0.5) * 0.38
            err = np.vstack([rows["mean"] - rows["min"], rows["max"] - rows["mean"]])
            ax.bar(x, rows["mean"], width=0.38, label=source, yerr=None if source == "paper" else err, capsize=4)
        ax.axhline(0, color="gray", lw=0.8)
        ax.set_xticks(np.arange(len(modes)), modes, rotation=30, ha="right")
        ax.set(title=f"{figure.split(' (')[0]} vs baseline (whiskers: range over seeds)", ylabel=figure)
        ax.legend(loc="best")
    return axes


BREAKDOWN_LABELS = {
    "compute_s": "compute",
    "intra_comm_s": "intra-node exchanges",
    "inter_comm_s": "inter-node exchanges",
    "moe_comm_s": "experts' all-to-all",
    "grad_sync_s": "gradient sync",
    "optimizer_s": "optimizer",
    "imbalance_wait_s": "imbalance wait",
}


def plot_breakdown(summary: dict, ax=None):
    ax = ax or plt.figure(figsize=(8, 4)).gca()
    modes = run_modes(summary)
    bottom = np.zeros(len(modes))
    for key in BREAKDOWN:
        vals = np.array([summary["modes"][m]["mean_" + key] or 0.0 for m in modes])
        ax.bar(modes, vals, bottom=bottom, label=BREAKDOWN_LABELS[key])
        bottom += vals
    ax.set(title="Where a step's time goes (mean over ranks and steps)", xlabel="mode", ylabel="seconds per step")
    ax.set_xticks(np.arange(len(modes)), modes, rotation=30, ha="right")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return ax


# the sweep plot's lines: every mode whose wide parents take children (Ulysses or halo), in the table's order
SWEEP_MODES = tuple(m.name for m in MODE_TABLE if m.start in (CHILDREN, HALO_CHILDREN))


SWEEP_FACTORS = {  # the sweep plot's columns (those a sweep ran), and their axes' labels
    "fill": "fill (global batch / cluster capacity)",
    "ratio": "inter/intra-node all-to-all ratio",
    "window": "sliding window W (tokens)",
    "state": "linear layers' head_k_dim = head_v_dim (state size)",
    "overlap": "head blocks the exchanges are pipelined in (1: none)",
}


def plot_sweep(path: str | None = None, axes=None):
    """The gain against the fill, the ratio (both readings: solid group, dashed link), the window
    and a linear kind's state size, those the sweep ran, mean over seeds with the [min, max] band:
    a row per assignment pricing, a colour per mode."""
    path = path or os.path.join(RESULTS, "sweep", "sweep.csv")
    if not os.path.exists(path):
        print(f"no sweep results at {path}: run `python -m experiments.sweep` to add these plots", file=sys.stderr)
        return None
    df = pd.read_csv(path)
    df = df[df["mode"].isin(SWEEP_MODES) & df["factor"].isin(list(SWEEP_FACTORS))]
    factors = {f: label for f, label in SWEEP_FACTORS.items() if f in set(df["factor"])}
    pricings = sorted(df["assignment_pricing"].unique())
    if axes is None:
        _, axes = plt.subplots(len(pricings), len(factors), figsize=(6 * len(factors), 4 * len(pricings)), squeeze=False)
    colour = dict(zip(SWEEP_MODES, sns.color_palette("tab10", len(SWEEP_MODES))))
    for row, pricing in zip(axes, pricings):
        for ax, (factor, xlabel) in zip(row, factors.items()):
            sub = df[(df["factor"] == factor) & (df["assignment_pricing"] == pricing)].assign(value=lambda d: d["value"].astype(float))
            for (mode, reading), g in sub.groupby(["mode", "ratio_reading"]):
                agg = g.groupby("value")["time_change_pct"].agg(["mean", "min", "max"]).reset_index()
                style = "-" if reading == "group" else "--"
                label = mode if reading == "group" else None  # one legend entry per mode; dashed: the link reading
                ax.plot(agg["value"], agg["mean"], style, marker="o", color=colour[mode], label=label)
                ax.fill_between(agg["value"], agg["min"], agg["max"], color=colour[mode], alpha=0.12)
            ax.axhline(0, color="gray", lw=0.8)
            if factor in ("window", "state", "overlap"):
                ax.set_xscale("log", base=2)
            ax.set(title=f"Gain vs {factor}, {pricing} pricing", xlabel=xlabel, ylabel="change of mean step time (%)")
            ax.legend(fontsize=7, title="dashed: link reading" if factor == "ratio" else None, title_fontsize=7)
    return axes


def plot_predicted_vs_measured(path: str | None = None, ax=None):
    """Each step's measured time on the emulated cluster against the simulator's prediction under
    the calibrated profile (experiments.emulate --compare), by mode, with the y = x line."""
    path = path or os.path.join(RESULTS, "emulated", "compare.csv")
    if not os.path.exists(path):
        print(f"no comparison at {path}: run `python -m experiments.emulate --compare` (as root) to add it", file=sys.stderr)
        return None
    df = pd.read_csv(path)
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 5.5))
    sns.scatterplot(data=df, x="predicted_s", y="measured_s", hue="mode", hue_order=[m for m in MODES if m in set(df["mode"])], ax=ax)
    hi = float(max(df["predicted_s"].max(), df["measured_s"].max())) * 1.05
    ax.plot([0, hi], [0, hi], color="grey", lw=0.8, ls="--", label="y = x")
    ax.set(xlim=(0, hi), ylim=(0, hi), xlabel="predicted step time (s)", ylabel="measured step time (s)", title="Simulated vs measured")
    ax.legend(fontsize=8)
    return ax


def plot_layouts(plan: StepPlan, axes=None):
    """Which samples sit on which ranks, in the parent and the child layout (node boundaries marked)."""
    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    world, g = plan.cluster.world_size, plan.cluster.gpus_per_node
    colors = plt.get_cmap("tab20")
    for ax, layout, title in (
        (axes[0], plan.parent_layout, "parent layout (full attention)"),
        (axes[1], plan.child_layout, "child layout (sparse layers, token-wise work)"),
    ):
        longest = max(plan.length_of.values())
        # one bar per sample and group, as wide as the group (each of its ranks holds 1/size of
        # the sample), every bar of the layout drawn in one call
        x, width, height, bottom, color, edge = [], [], [], [], [], []
        for grp in layout.groups:
            base = 0.0
            for s in grp.samples:
                n = layout.lengths[s]
                x.append(grp.start - 0.45)
                width.append(grp.size - 0.1)
                height.append(n / grp.size)
                bottom.append(base)
                color.append(colors(s % 20))
                edge.append("black" if n == longest else "none")
                base += n / grp.size
            ax.add_patch(plt.Rectangle((grp.start - 0.45, 0), grp.size - 0.1, base, fill=False, lw=1.2))
        if x:
            ax.bar(x, height, width=width, bottom=bottom, align="edge", color=color, edgecolor=edge, linewidth=0.6)
        for n in range(1, world // g):
            ax.axvline(n * g - 0.5, color="red", ls="--", lw=1)
        ax.set(title=title, ylabel="tokens per rank")
    axes[1].set_xlabel("rank (red dashed lines: node boundaries; boxes: groups; outlined: the longest sample)")
    return axes


def plot_entry_bytes(plan: StepPlan, cost: CostModel, axes=None):
    """Rank-to-rank bytes of the full-attention entry exchange: inside a node (left) and across
    nodes (right), each on its own scale."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    cost = cost.for_cluster(plan.cluster)
    world, g = plan.cluster.world_size, plan.cluster.gpus_per_node
    plans = token_to_head_plan(plan.child_layout, plan.parent_layout)
    m = np.zeros((world, world))
    for grp in plan.parent_layout.groups:
        sub = {r: plans[r] for r in grp.ranks}
        m += exchange_bytes(sub, world, int(cost.entry_row_bytes(grp.size) / grp.size))
    np.fill_diagonal(m, 0)
    node = np.arange(world) // g
    same = node[:, None] == node[None, :]
    for ax, mask, title, cmap in ((axes[0], same, "inside a node", "Blues"), (axes[1], ~same, "across nodes", "Reds")):
        shown = np.where(mask, m, np.nan) / 1e6
        im = ax.imshow(shown, cmap=cmap, vmin=0)
        plt.colorbar(im, ax=ax, label="MB sent")
        for n in range(1, world // g):
            ax.axhline(n * g - 0.5, color="black", lw=0.5)
            ax.axvline(n * g - 0.5, color="black", lw=0.5)
        total = np.nansum(shown)
        ax.set(title=f"Entry exchange bytes {title}: {total:,.0f} MB", xlabel="receiving rank", ylabel="sending rank")
    return axes
