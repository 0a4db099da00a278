"""The ablation on the embedded simulator, for its entry point (python -m experiments.ablation)
and its sweep: the command line (COMMAND) and the tables it prints. The run itself is shared
(experiments.common.ablation) and taken from there."""

from __future__ import annotations

import sys

from config import Cluster, CostsConfig, HardwareConfig, ModelConfig, PlannerConfig, WorkloadConfig
from config.cli import Command
from config.entries import AblationOptions
from experiments.common.ablation import control_pair
from experiments.common.lengths import describe
from experiments.common.settings import MODEL_CHOICES
from solver.modes import MODE_TABLE, MODES, REFERENCE, modes_help

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
    p(f"model shapes: {ModelConfig.from_dict(cfg['model']).describe()}")
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
