"""Plots for the notebooks (the notebooks stay thin: load results, call these).

python -m experiments.plots          # renders docs/figures/*.png from results/ (running the ablation if needed)
"""

from __future__ import annotations

import argparse
import os
import sys

import matplotlib

matplotlib.use(os.environ.get("MPLBACKEND", "Agg"))
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from solver import MODES, CostModel, StepPlan, exchange_bytes, token_to_head_plan  # noqa: E402

from .results import PAPER, read_run  # noqa: E402

RESULTS = os.environ.get("REPACK_RESULTS", "results")


def load_or_run_ablation(folder: str | None = None) -> tuple[pd.DataFrame, dict]:
    """The ablation's rows and summary; runs the ablation on its defaults if there are none."""
    folder = folder or os.path.join(RESULTS, "ablation")
    if not os.path.exists(os.path.join(folder, "summary.json")):
        from .ablation import main as ablation_main

        print(f"no results in {folder}: running the ablation on its defaults", file=sys.stderr)
        ablation_main(["--out", folder, "--no-progress"])
    rows, summary = read_run(folder)
    return pd.DataFrame(rows), summary


def load_measured(folder: str | None = None) -> tuple[pd.DataFrame, dict] | None:
    folder = folder or os.path.join(RESULTS, "train")
    if not os.path.exists(os.path.join(folder, "summary.json")):
        return None
    rows, summary = read_run(folder)
    return pd.DataFrame(rows), summary


def plot_step_times(df: pd.DataFrame, ax=None):
    ax = ax or plt.figure(figsize=(10, 4)).gca()
    sns.barplot(data=df, x="step", y="step_time_s", hue="mode", hue_order=list(MODES), ax=ax)
    ax.set(title="Step time of each selected step by mode (simulated)", xlabel="training step", ylabel="step time (s)")
    ax.tick_params(axis="x", rotation=90)
    return ax


def mean_changes(summary: dict) -> pd.DataFrame:
    recs = []
    for m in MODES[1:]:
        e = summary["modes"][m]
        recs.append({"mode": m, "source": "ours", "step time change (%)": e["time_change_pct"], "MFU change (pp)": e["mfu_change_pp"]})
        recs.append(
            {
                "mode": m,
                "source": "paper",
                "step time change (%)": PAPER[m]["time_change_pct"],
                "MFU change (pp)": PAPER[m]["mfu_change_pp"],
            }
        )
    return pd.DataFrame(recs)


def plot_mean_changes(summary: dict, axes=None):
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(10, 4))
    d = mean_changes(summary)
    sns.barplot(data=d, x="mode", y="step time change (%)", hue="source", ax=axes[0])
    axes[0].set(title="Mean step time vs baseline", xlabel="mode", ylabel="change of mean step time (%)")
    sns.barplot(data=d, x="mode", y="MFU change (pp)", hue="source", ax=axes[1])
    axes[1].set(title="MFU vs baseline", xlabel="mode", ylabel="MFU change (percentage points)")
    return axes


def plot_breakdown(summary: dict, ax=None):
    ax = ax or plt.figure(figsize=(7, 4)).gca()
    parts = [
        ("compute", "mean_compute_s"),
        ("intra-node comm", "mean_intra_comm_s"),
        ("inter-node comm", "mean_inter_comm_s"),
        ("imbalance wait", "mean_imbalance_wait_s"),
    ]
    bottom = np.zeros(len(MODES))
    for label, key in parts:
        vals = np.array([summary["modes"][m][key] for m in MODES])
        ax.bar(list(MODES), vals, bottom=bottom, label=label)
        bottom += vals
    ax.set(title="Where a step's time goes (mean over ranks and steps)", xlabel="mode", ylabel="seconds per step")
    ax.legend(loc="lower right")
    return ax


def plot_sweep(path: str | None = None, axes=None):
    path = path or os.path.join(RESULTS, "sweep", "sweep.csv")
    if not os.path.exists(path):
        print(f"no sweep results at {path}: run `python -m experiments.sweep` to add these plots", file=sys.stderr)
        return None
    df = pd.read_csv(path)
    df = df[df["mode"].isin(MODES[1:])]
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, factor, xlabel in (
        (axes[0], "ratio", "inter/intra-node all-to-all bandwidth ratio"),
        (axes[1], "long_share", "long-document probability per document"),
    ):
        sub = df[df["factor"] == factor]
        sns.lineplot(data=sub, x="value", y="time_change_pct", hue="mode", marker="o", ax=ax)
        ax.axhline(0, color="gray", lw=0.8)
        ax.set(title=f"Gain vs {factor.replace('_', ' ')}", xlabel=xlabel, ylabel="change of mean step time (%)")
        if factor == "long_share":
            ax.set_xscale("log")
    return axes


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
        for grp in layout.groups:
            tokens = [layout.lengths[s] for s in grp.samples]
            base = 0.0
            for s, n in zip(grp.samples, tokens):
                per_rank = n / grp.size
                ax.bar(
                    np.arange(grp.start, grp.stop),
                    per_rank,
                    bottom=base,
                    width=0.9,
                    color=colors(s % 20),
                    edgecolor="black" if n == max(plan.length_of.values()) else "none",
                    linewidth=0.6,
                )
                base += per_rank
            ax.add_patch(plt.Rectangle((grp.start - 0.45, 0), grp.size - 0.1, base, fill=False, lw=1.2))
        for n in range(1, world // g):
            ax.axvline(n * g - 0.5, color="red", ls="--", lw=1)
        ax.set(title=title, ylabel="tokens per rank")
    axes[1].set_xlabel("rank (red dashed lines: node boundaries; boxes: groups; outlined: the longest sample)")
    return axes


def plot_entry_bytes(plan: StepPlan, cost: CostModel, ax=None):
    """Rank-to-rank bytes of the full-attention entry exchange, intra- and inter-node."""
    ax = ax or plt.figure(figsize=(7, 6)).gca()
    world, g = plan.cluster.world_size, plan.cluster.gpus_per_node
    plans = token_to_head_plan(plan.child_layout, plan.parent_layout)
    m = np.zeros((world, world))
    for grp in plan.parent_layout.groups:
        sub = {r: plans[r] for r in grp.ranks}
        m += exchange_bytes(sub, world, int(cost.entry_row_bytes(grp.size) / grp.size))
    np.fill_diagonal(m, 0)
    node = np.arange(world) // g
    signed = np.where(node[:, None] == node[None, :], m, -m) / 1e6
    lim = np.abs(signed).max() or 1
    im = ax.imshow(signed, cmap="coolwarm_r", vmin=-lim, vmax=lim)
    plt.colorbar(im, ax=ax, label="MB sent (blue: inside a node, red: across nodes)")
    for n in range(1, world // g):
        ax.axhline(n * g - 0.5, color="black", lw=0.5)
        ax.axvline(n * g - 0.5, color="black", lw=0.5)
    ax.set(title="Entry exchange bytes, sender -> receiver", xlabel="receiving rank", ylabel="sending rank")
    return ax


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="docs/figures")
    args = ap.parse_args(argv)
    df, summary = load_or_run_ablation()
    os.makedirs(args.out, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2))
    plot_mean_changes(summary, axes[:2])
    plot_breakdown(summary, axes[2])
    ctx = summary["context"]
    fig.suptitle(f"Layerwise Repacking ablation, simulated ({len(summary['selected_steps'])} steps; commit {ctx['commit']})")
    fig.tight_layout()
    path = os.path.join(args.out, "ablation.png")
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
