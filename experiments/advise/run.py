"""The decision, for its entry point (python -m experiments.advise) and the notebooks: which mode to
run for this model, workload and cluster, judged over the whole run (every step, the steps without
a wide parent in the denominator), with what each mode costs to plan, which of its pieces have run
on a GPU, and how the answer moves with the two assumptions that move it most.

    settings = entry.parse(COMMAND, ["--lengths", "my_lengths.txt", "--world-size", "128"], resolve_workload=False)
    result = advise(settings)          # a dict (what advise.json holds)
    print(render(result))              # the screen the command prints
    draw(result, "advise.png")         # each mode's whole-run change against the ratio and the fill
"""

from __future__ import annotations

import math

from config import Cluster, CostsConfig, HardwareConfig, ModelConfig, PlannerConfig, WorkloadConfig
from config.cli import Command, Settings
from config.entries import AdviseOptions
from experiments.common.ablation import SeedJob, ablation_jobs, run_jobs, summarize_ablation
from experiments.common.gpu_pieces import PIECES, gpu_status, pieces_of
from experiments.common.lengths import describe
from experiments.common.provenance import provenance
from experiments.common.settings import MODEL_CHOICES, cost_model, prepare
from solver.modes import REFERENCE, mode_of, modes_for, modes_help

DESCRIPTION = """Will repacking pay on my cluster? One screen: the recommended mode and the runner-up with each
one's change of the whole run's time vs the baseline (every step of the run, its seed range),
the change over the steps with parents wider than a node alone (the paper's figure), each mode's
planning time per step against the baseline planner's, which of the pieces a mode uses have run on
a GPU, and each mode's whole-run change at other inter/intra-node ratios and fills.

    python -m experiments.advise --lengths my_lengths.txt --model paper-gdn --world-size 128 --gpus-per-node 8
    python -m experiments.advise --workload flexsp-wikipedia --hardware results/calibrate/profile.json

Every way to run a job is a candidate (the controls of the ablation are not: baseline+solver,
redistribute, parent+halo); a mode pays when it saves at least --min-gain percent of the whole
run on every seed, and of modes that tie (the same plans) the one that plans faster is named.
Writes <out>/advise.json (every figure, with the settings and provenance) and <out>/advise.png.
The ablation (python -m experiments.ablation) has the detail behind each figure.
"""
SECTIONS = (ModelConfig, HardwareConfig, Cluster, CostsConfig, WorkloadConfig, PlannerConfig)
COMMAND = Command("experiments.advise", DESCRIPTION, (*SECTIONS, AdviseOptions), choices=MODEL_CHOICES, epilog=modes_help())


def _values(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def points(settings: Settings) -> tuple[Settings, list[tuple[str, float, Settings]]]:
    """The run's prepared settings, and (factor, value, prepared settings) of each sensitivity
    point: the hardware's ratio replaced by each of --vary-ratio, the workload's fill by each of
    --vary-fill (not for a trace, whose steps are fixed), a value equal to the run's own left out
    (the main run has it). SettingError, naming the point, before any work."""
    base = prepare(settings)
    opts, out = settings.advise, []
    own_ratio = base.hardware.inter_intra_ratio
    for r in _values(opts.vary_ratio):
        if not math.isclose(r, own_ratio):
            out.append(("ratio", r, prepare(settings.replace(hardware=settings.hardware.replace(inter_intra_ratio=r)))))
    if not base.workload.trace:
        own_fill = base.workload.tokens_per_step / (base.cluster.world_size * base.cluster.tokens_per_rank)
        for f in _values(opts.vary_fill):
            if not math.isclose(f, own_fill, rel_tol=1e-3):
                out.append(("fill", f, prepare(settings.replace(workload=settings.workload.replace(fill=f, tokens_per_step=None)))))
    return base, out


def candidates(kind) -> list[str]:
    """The modes the advice weighs: every mode the sparse kind can run that is a way to run a job,
    not a study's control (Mode.control), the baseline first."""
    return [m for m in modes_for(kind) if not mode_of(m).control]


def advise(settings: Settings, progress: bool = True, prepared=None) -> dict:
    """The decision for `settings` (parsed with resolve_workload=False; its advise section read):
    every candidate mode over the whole run for --seeds seeds, and at each sensitivity point for
    --sensitivity-seeds seeds, all on as many processes as there are cores. `prepared`: what
    points(settings) gave, where the caller checked them already. Returns what advise.json holds."""
    opts = settings.advise
    base, pts = prepared if prepared is not None else points(settings)
    kind = cost_model(base).sparse
    modes = candidates(kind)
    seed0 = base.workload.seed
    main_jobs = ablation_jobs(base, list(range(seed0, seed0 + opts.seeds)), modes, whole=True)
    side = [(f, v, ablation_jobs(s, list(range(seed0, seed0 + opts.sensitivity_seeds)), modes, whole=True)) for f, v, s in pts]
    jobs: list[SeedJob] = main_jobs + [j for _, _, js in side for j in js]
    results = run_jobs(jobs, progress, desc=f"{len(jobs)} runs ({len(modes)} modes, every step)")
    rows, summary = summarize_ablation(base, main_jobs, results[: len(main_jobs)])
    whole = summary["whole_run"]
    sensitivity, at = [], len(main_jobs)
    for factor, value, js in side:
        _, s = summarize_ablation(js[0].settings, js, results[at : at + len(js)])
        at += len(js)
        sensitivity.append({"factor": factor, "value": value, "whole_run": {m: s["whole_run"]["over_seeds"][m]["mean"] for m in modes}})
    own_seeds = [str(j.seed) for j in main_jobs[: opts.sensitivity_seeds]]
    own = {m: sum(whole["per_seed"][k][m] for k in own_seeds) / len(own_seeds) for m in modes}
    cfg = summary["config"]
    sensitivity += [
        {"factor": "ratio", "value": cfg["hardware"]["inter_intra_ratio"], "whole_run": own, "own": True},
        {"factor": "fill", "value": cfg["fill"], "whole_run": own, "own": True} if not cfg["workload"].get("trace") else None,
    ]
    sensitivity = sorted((p for p in sensitivity if p), key=lambda p: (p["factor"], p["value"]))
    # the least whole-run time first; of modes that tie (the same plans), the one that plans faster
    ranked = sorted((m for m in modes if m != REFERENCE), key=lambda m: (whole["over_seeds"][m]["mean"], whole["plan_ms_per_step"][m]))
    best = ranked[0] if ranked else REFERENCE
    pays = bool(ranked) and whole["over_seeds"][best]["max"] <= -opts.min_gain
    recommended = best if pays else REFERENCE
    runner_up = ranked[1] if pays and len(ranked) > 1 else best
    over = summary["over_seeds"]
    per_mode = {}
    for m in modes:
        names = pieces_of(mode_of(m), kind)
        ran, never = gpu_status(names)
        per_mode[m] = {
            "whole_run_pct": whole["over_seeds"][m],
            "selected_steps_pct": over[m]["time_change_pct"] if m in over else None,
            "plan_ms_per_step": whole["plan_ms_per_step"][m],
            "plan_vs_baseline": whole["plan_ms_per_step"][m] / whole["plan_ms_per_step"][REFERENCE],
            "plan_share_of_step": 1e-3 * whole["plan_ms_per_step"][m] / whole["mean_step_s"][m],
            "gpu_pieces": names,
            "gpu_ran": ran,
            "gpu_never": never,
        }
    return {
        "provenance": provenance(),
        "config": cfg,
        "seeds": cfg["seeds"],
        "steps": whole["steps"],
        "selected_steps": summary["selected_steps"],
        "modes": per_mode,
        "recommended": recommended,
        "runner_up": runner_up,
        "pays": pays,
        "min_gain_pct": opts.min_gain,
        "sensitivity": sensitivity,
        "sensitivity_seeds": [int(k) for k in own_seeds],
        "gpu_runs": {n: PIECES[n].ran for n in sorted({n for v in per_mode.values() for n in v["gpu_ran"]})},
    }


def _pct(e: dict | None) -> str:
    if e is None:
        return "n/a"
    return f"{e['mean']:+.1f}% [{e['min']:+.1f}, {e['max']:+.1f}]"


def render(result: dict) -> str:
    """The screen the command prints."""
    cfg, modes = result["config"], result["modes"]
    cl, hw, wl = cfg["cluster"], cfg["hardware"], cfg["workload"]
    if wl.get("trace"):
        source = f"the trace {wl['trace']}"
    elif wl.get("lengths"):
        source = describe(wl["lengths"])
    else:
        source = "the synthetic mixture"
    steps = sum(result["steps"].values())
    wide = sum(len(v) for v in result["selected_steps"].values())
    lines = [
        f"{cfg['model']['name']} ({cfg['model']['sparse_kind']}) on {cl['world_size']} ranks ({cl['world_size'] // cl['gpus_per_node']} "
        f"nodes of {cl['gpus_per_node']}, {cl['tokens_per_rank']} tokens a rank), inter/intra ratio {hw['inter_intra_ratio']:g} "
        f"({hw['ratio_reading']}), fill {cfg['fill']:.2f}",
        f"documents from {source}; seeds {result['seeds']}: {wide} of {steps} steps have parents wider than a node (SP16/32)",
        "",
    ]
    rec, run = result["recommended"], result["runner_up"]
    if result["pays"]:
        lines.append(f"recommended: {rec:<14} whole run {_pct(modes[rec]['whole_run_pct'])} vs baseline")
        if run != rec:
            lines.append(f"runner-up:   {run:<14} whole run {_pct(modes[run]['whole_run_pct'])}")
    else:
        lines.append(
            f"no mode pays here: the best, {run}, changes the whole run by {_pct(modes[run]['whole_run_pct'])}, short of saving "
            f"{result['min_gain_pct']:g}% on every seed (--min-gain): run the baseline"
        )
    lines += [
        "",
        f"{'mode':>14}  {'whole run':>22}  {'steps with wide parents':>23}  {'planning a step':>24}  GPU (pieces it uses)",
    ]
    for m, e in modes.items():
        plan = f"{e['plan_ms_per_step']:.1f} ms ({e['plan_vs_baseline']:.1f}x, {100 * e['plan_share_of_step']:.2f}%)"
        never = ", ".join(e["gpu_never"])
        gpu = f"{len(e['gpu_ran'])} of {len(e['gpu_ran']) + len(e['gpu_never'])} ran; never: {never}" if never else "all ran"
        lines.append(f"{m:>14}  {_pct(e['whole_run_pct']):>22}  {_pct(e['selected_steps_pct']):>23}  {plan:>24}  {gpu}")
    lines.append(
        "  (whole run and wide steps: step time vs baseline, mean [min, max] over seeds; planning: ms per step on this host, "
        "x the baseline planner's, % of the mode's step)"
    )
    sens = result["sensitivity"]
    head = [f"{p['factor']} {p['value']:g}{' (yours)' if p.get('own') else ''}" for p in sens]
    lines += ["", f"what moves it (whole run vs baseline, seed{'s' if len(result['sensitivity_seeds']) > 1 else ''} "
              f"{', '.join(map(str, result['sensitivity_seeds']))}):"]  # fmt: skip
    lines.append(f"{'mode':>14}  " + "  ".join(f"{h:>15}" for h in head))
    for m in modes:
        if m == REFERENCE:
            continue
        lines.append(f"{m:>14}  " + "  ".join(f"{p['whole_run'][m]:>+14.1f}%" for p in sens))
    best_at = [min((m for m in modes if m != REFERENCE), key=lambda m: p["whole_run"][m], default=REFERENCE) for p in sens]
    lines.append(f"{'best':>14}  " + "  ".join(f"{b:>15}" for b in best_at))
    if result["gpu_runs"]:
        lines += ["", "what has run on a GPU (experiments/common/gpu_pieces.py; the rest never has):"]
        lines += [f"  {n}: {why}" for n, why in result["gpu_runs"].items()]
    return "\n".join(lines)


def draw(result: dict, path: str) -> None:
    """Each candidate's whole-run change against the ratio and against the fill (the sensitivity's
    points and the run's own), written to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    factors = sorted({p["factor"] for p in result["sensitivity"]})
    fig, axes = plt.subplots(1, len(factors), figsize=(5 * len(factors), 3.6), squeeze=False)
    for ax, factor in zip(axes[0], factors):
        pts = [p for p in result["sensitivity"] if p["factor"] == factor]
        xs = [p["value"] for p in pts]
        for m in result["modes"]:
            ax.plot(xs, [p["whole_run"][m] for p in pts], marker="o", label=m)
        for p in pts:
            if p.get("own"):
                ax.axvline(p["value"], color="grey", lw=0.8, ls=":")
        ax.axhline(-result["min_gain_pct"], color="grey", lw=0.8, ls="--")
        ax.set_xlabel("inter/intra-node ratio" if factor == "ratio" else "fill of the cluster's tokens")
        ax.set_ylabel("whole run vs baseline (%)")
        if factor == "ratio":
            ax.set_xscale("log")
    axes[0][0].legend(fontsize=7)
    cfg = result["config"]
    fig.suptitle(f"{cfg['model']['name']}, {cfg['cluster']['world_size']} ranks: dotted, yours; dashed, --min-gain", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
