"""A two-tier cluster on one machine, and the simulator checked against steps measured on it.

    # as root: 4 emulated nodes x 2 gloo ranks, 800 Mbit/s between nodes: calibrate, replay, compare
    python -m experiments.calibrate.emulate --nodes 4 --gpus-per-node 2 --compare --out results/emulated
    # or any module, launched as on a multi-node cluster
    python -m experiments.calibrate.emulate --nodes 2 --gpus-per-node 2 -- -m experiments.calibrate --quick --out /tmp/cal

One network namespace per node, each joined by a veth link to a bridge in a hub namespace; `tc`
(a token-bucket filter) limits each link to --inter-mbit in both directions, so ranks inside a
namespace talk over its loopback and ranks in different namespaces over the limited links: two
tiers, like NVLink inside a node and the network across nodes. torchrun runs once per namespace
with c10d rendezvous on node 0's address, as on a real multi-node cluster (its `--local-addr` and
GLOO_SOCKET_IFNAME name the node's link); the driver's node-local groups come from
LOCAL_WORLD_SIZE. The addresses (10.213.0.0/24) exist only inside the namespaces this script
creates; no traffic leaves the machine. Every run has a timeout; the namespaces and links are
removed on exit, on failure and on Ctrl-C. The --wall-limit bounds every launched run.

--compare: (1) calibrates on the emulated cluster (experiments.calibrate, quick sizes, each figure
the median of CALIBRATION_MEDIAN_OF runs); (2) runs the ablation
with the tiny model (--model: any model preset of tiny's sizes, e.g. tiny-gdn, whose sparse layers
are Gated DeltaNet) on the cluster's shape and the calibrated profile, on a trace of the tiny
workload (the simulator's prediction of every selected step in every mode); (3) replays those
steps through the driver on the emulated cluster in every mode (train --replay --mode all: no
optimizer step, so the ablation leaves the optimizer out; expert parallelism on, of the default
degree, a node's ranks, on both sides, the ablation pricing the experts' all-to-all at the
calibrated rates and hidden share; with --timers, each step's phases timed, and --repeats rounds
over the modes, each mode's fastest kept); (4) compares each step's measured time with the prediction: per
mode the median and worst relative error, and the measured against the predicted change vs
baseline, and the mean measured phases beside the simulator's terms. Writes <out>/compare.csv (a
row per step and mode) and compare.json (the summary and the breakdown, with context).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

from config import TINY_TOKENS_PER_RANK, Cluster, ModelConfig, SettingError, WorkloadConfig
from config.cli import Command
from config.entries import EmulateOptions
from experiments.common import entry
from experiments.common.errors import USER_ERRORS
from experiments.common.files import check_output_dir
from experiments.common.provenance import provenance
from experiments.common.results import GAP_PARTS, gap_by_part, paired_steps
from experiments.common.workload import generate_steps
from solver.modes import MODES, REFERENCE

SUBNET = "10.213.0"
# the calibration's medians on the emulated cluster: the replay's exchanges are latency-bound and
# its fixed costs come from one timed step, so the quick plan's 3 runs leave them too noisy
CALIBRATION_MEDIAN_OF = 9
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2)"
    probe = f"lrprobe{os.getpid()}"
    p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if p.returncode:
        return f"'ip netns add' fails: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sh(*cmd: str) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {p.stderr.strip()}")


BURST_MS = 2.0  # the token bucket's default burst, in ms of the link's rate
MIN_BURST_KB = 8


def default_burst_kb(inter_mbit: float) -> int:
    """The burst a link's token bucket gets unless --burst-kb says otherwise: BURST_MS of its rate,
    at least MIN_BURST_KB (20 KB at 80 Mbit/s, 200 KB at 800).

    A NIC passes nothing faster than its rate, so a burst should be small: a bucket of 256 KB let
    the calibration's lone calls through at the loopback's speed while a step's back-to-back calls
    found it drained, and the simulator priced the calls a busy step makes below what they measured
    (docs/calibration.md). The bucket must still hold what the link passes between two of the
    kernel's timer ticks (1 ms at HZ=1000), or the link runs below its rate; 2 ms is twice that."""
    return max(MIN_BURST_KB, math.ceil(inter_mbit * 1e6 / 8 * BURST_MS / 1e3 / 1e3))


class EmulatedCluster:
    """Namespaces and links for `nodes` nodes; a context manager that always removes them."""

    def __init__(self, nodes: int, inter_mbit: float, burst_kb: int | None = None):
        if not 2 <= nodes <= 32:
            raise SettingError(f"--nodes={nodes} is invalid: it must be an integer in [2, 32]")
        if not inter_mbit > 0:
            raise SettingError(f"--inter-mbit={inter_mbit} is invalid: it must be a rate > 0")
        self.nodes, self.mbit = nodes, inter_mbit
        self.burst = default_burst_kb(inter_mbit) if burst_kb is None else burst_kb
        tag = f"{os.getpid() % 100000}"
        self.hub = f"lrhub{tag}"
        self.names = [f"lrn{tag}x{k}" for k in range(nodes)]

    def address(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def __enter__(self):
        try:
            _sh("ip", "netns", "add", self.hub)
            _sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.hub, "link", "set", "br0", "up")
            for k, ns in enumerate(self.names):
                _sh("ip", "netns", "add", ns)
                a, b = f"lra{k}x{os.getpid() % 10000}", f"lrb{k}x{os.getpid() % 10000}"
                _sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
                _sh("ip", "link", "set", a, "netns", ns)
                _sh("ip", "link", "set", b, "netns", self.hub)
                _sh("ip", "-n", ns, "link", "set", a, "name", "eth0")
                _sh("ip", "-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
                _sh("ip", "-n", ns, "link", "set", "eth0", "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                _sh("ip", "-n", self.hub, "link", "set", b, "master", "br0")
                _sh("ip", "-n", self.hub, "link", "set", b, "up")
                rate = f"{self.mbit}mbit"
                for where, dev in ((ns, "eth0"), (self.hub, b)):  # both directions of the node's link
                    _sh(
                        "ip",
                        "netns",
                        "exec",
                        where,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        rate,
                        "burst",
                        f"{self.burst}kb",
                        "latency",
                        "100ms",
                    )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for ns in [*self.names, self.hub]:  # deleting a namespace deletes its links
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        return False

    def run(self, module_args: list[str], ranks_per_node: int, timeout: float, log_dir: str) -> list[int]:
        """torchrun once per namespace with c10d rendezvous; (return code per node). Logs go to
        log_dir/node<k>.log. Every node's launcher is killed at the timeout."""
        port = 29400 + os.getpid() % 500
        procs = []
        for k, ns in enumerate(self.names):
            cmd = [
                "ip", "netns", "exec", ns, "env", "GLOO_SOCKET_IFNAME=eth0", f"PYTHONPATH={ROOT}",
                sys.executable, "-m", "torch.distributed.run",
                f"--nnodes={self.nodes}", f"--nproc-per-node={ranks_per_node}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={self.address(0)}:{port}", f"--rdzv-id=lr{port}",
                f"--rdzv-conf=is_host={1 if k == 0 else 0}", f"--local-addr={self.address(k)}",
                *module_args,
            ]  # fmt: skip
            log = open(os.path.join(log_dir, f"node{k}.log"), "w")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
        deadline = time.monotonic() + timeout
        codes = []
        try:
            for p, log in procs:
                try:
                    codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    codes.append(124)
                log.close()
        finally:  # no launcher outlives the run, nor a SIGTERM or Ctrl-C of it (each runs in a session of its own)
            for p, log in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                log.close()
        return codes


def _run_or_fail(cluster: EmulatedCluster, args: list[str], rpn: int, timeout: float, log_dir: str, what: str) -> None:
    os.makedirs(log_dir, exist_ok=True)
    codes = cluster.run(args, rpn, timeout, log_dir)
    if any(codes):
        tail = open(os.path.join(log_dir, "node0.log")).read()[-2000:]
        raise RuntimeError(f"{what} failed on the emulated cluster (return codes {codes}); node 0's log ends:\n{tail}")


def compare(pairs: list[tuple[dict, dict]]) -> tuple[list[dict], dict]:
    """Rows per (step, mode) of paired_steps with the predicted and measured step time, and per
    mode the errors and the changes vs baseline (means over the steps both have)."""
    rows = []
    for s, r in pairs:
        rows.append(
            {
                "step": r["step"],
                "mode": r["mode"],
                "predicted_s": s["step_time_s"],
                "measured_s": r["step_time_s"],
                "rel_error": s["step_time_s"] / r["step_time_s"] - 1,
                "same_plan": s["plan_hash"] == r["plan_hash"],
            }
        )
    summary = {}
    base = {(r["step"]): r for r in rows if r["mode"] == REFERENCE}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode and r["step"] in base]
        if not mine:
            continue
        err = np.array([r["rel_error"] for r in mine])
        pred = np.mean([r["predicted_s"] / base[r["step"]]["predicted_s"] - 1 for r in mine])
        meas = np.mean([r["measured_s"] / base[r["step"]]["measured_s"] - 1 for r in mine])
        summary[mode] = {
            "steps": len(mine),
            "median_abs_rel_error_pct": 100 * float(np.median(np.abs(err))),
            "worst_abs_rel_error_pct": 100 * float(np.max(np.abs(err))),
            "predicted_change_pct": 100 * float(pred),
            "measured_change_pct": 100 * float(meas),
            "change_gap_pp": 100 * float(pred - meas),
            "same_plans": all(r["same_plan"] for r in mine),
        }
    return rows, summary


def run_compare(s) -> None:
    e, gpn, model = s.emulate, s.cluster.gpus_per_node, s.model.name
    out = os.path.abspath(e.out)
    check_output_dir(out)
    world = e.nodes * gpn
    calibrated = os.path.join(out, "calibrate")
    profile = os.path.join(calibrated, "profile.json")
    trace = os.path.join(out, "trace.csv")
    with EmulatedCluster(e.nodes, e.inter_mbit, e.burst_kb) as cluster:
        print(
            f"emulated cluster: {e.nodes} nodes x {gpn} gloo ranks, {e.inter_mbit:g} Mbit/s between nodes (burst {cluster.burst} KB); "
            f"model {model}",
            flush=True,
        )
        _run_or_fail(
            cluster,
            ["-m", "experiments.calibrate", "--model", model, "--quick", "--median-of", str(CALIBRATION_MEDIAN_OF), "--out", calibrated],
            gpn,
            e.wall_limit,
            os.path.join(out, "logs", "calibrate"),
            "calibration",
        )
        # the calibration's report as node 0 printed it, whole (its last lines are the fits a step pays)
        print(open(os.path.join(out, "logs", "calibrate", "node0.log")).read().split("hardware profile:", 1)[-1], flush=True)
        # the tiny workload, sized to the cluster as the driver sizes it, as a trace both sides read
        budget = TINY_TOKENS_PER_RANK
        wl = WorkloadConfig.from_name("tiny", steps=s.workload.steps, seed=s.workload.seed)
        wl = wl.for_cluster(Cluster(world, gpn, budget)).clipped(world * budget)
        with open(trace, "w") as f:
            f.write("step,length\n")
            for k, lengths in enumerate(generate_steps(wl)):
                f.writelines(f"{k},{n}\n" for n in lengths)
        common = ["--model", model, "--gpus-per-node", str(gpn), "--tokens-per-rank", str(budget), "--hardware", profile]
        abl = [
            sys.executable, "-m", "experiments.ablation", *common, "--costs", profile, "--world-size", str(world), "--trace", trace,
            "--seeds", "1", "--no-optimizer", "--out", os.path.join(out, "predicted"), "--no-progress",
        ]  # fmt: skip
        p = subprocess.run(abl, cwd=ROOT, capture_output=True, text=True, timeout=e.wall_limit)
        if p.returncode:
            raise RuntimeError(f"the ablation failed: {p.stderr[-2000:]}")
        replay = ["--replay", os.path.join(out, "predicted"), "--mode", "all", "--out", os.path.join(out, "measured")]
        _run_or_fail(
            cluster,
            ["-m", "experiments.train", *common, *replay, "--timers", "--repeats", str(e.repeats)],
            gpn,
            e.wall_limit * e.repeats,  # each repeat is a whole replay's work
            os.path.join(out, "logs", "replay"),
            "the replay",
        )
    pairs = paired_steps(os.path.join(out, "predicted"), os.path.join(out, "measured"))
    rows, summary = compare(pairs)
    with open(os.path.join(out, "compare.csv"), "w") as f:
        f.write(",".join(rows[0]) + "\n")
        f.writelines(",".join(str(v) for v in r.values()) + "\n" for r in rows)
    parts = breakdown(pairs)
    result = {
        "provenance": provenance(),
        "cluster": {"nodes": e.nodes, "ranks_per_node": gpn, "inter_mbit": e.inter_mbit, "burst_kb": cluster.burst},
        "model": model,
        "modes": summary,
        "breakdown": parts,
    }
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump(result, f, indent=1)
    gaps = gap_by_part(pairs)
    print(f"\nsimulated against measured ({len(rows)} step x mode pairs; predicted under the calibrated profile):")
    print(f"{'mode':>15} {'steps':>5} {'median |err|':>13} {'worst |err|':>12} {'predicted':>10} {'measured':>9} {'gap pp':>7} same plans")
    for mode, e in summary.items():
        print(
            f"{mode:>15} {e['steps']:5d} {e['median_abs_rel_error_pct']:12.1f}% {e['worst_abs_rel_error_pct']:11.1f}% "
            f"{e['predicted_change_pct']:+9.1f}% {e['measured_change_pct']:+8.1f}% {e['change_gap_pp']:+7.1f} {e['same_plans']}"
        )
    print(
        "\nwhere the time goes, mean seconds per step and rank (predicted: the simulator's terms; measured: --timers);"
        "\nan exchange column is a rank's time from arriving at a site's all-to-alls to their end, both sides:"
    )
    print(
        f"{'mode':>15} | {'xchg F':>6} {'meas.':>6} {'xchg S':>6} {'meas.':>6} {'experts':>7} {'meas.':>6} | "
        f"{'compute':>7} {'wait':>6} {'grads':>6} | "
        f"{'host':>6} {'fwd':>6} {'bwd':>6} {'a2a':>6} (measured)"
    )
    for mode, e in parts.items():
        p, m = e["predicted"], e["measured"]
        print(
            f"{mode:>15} | {p['exchange_full_s']:6.3f} {m['exchange_full_s']:6.3f} "
            f"{p['exchange_sparse_s']:6.3f} {m['exchange_sparse_s']:6.3f} {p['exchange_moe_s']:7.3f} {m['exchange_moe_s']:6.3f} | "
            f"{p['compute_s']:7.3f} {p['imbalance_wait_s']:6.3f} {p['grad_sync_s']:6.3f} | "
            f"{m['host_s']:6.3f} {m['forward_s']:6.3f} {m['backward_s']:6.3f} {m['exchange_a2a_s']:6.3f}"
        )
    print("\neach mode's gap (predicted minus measured change vs baseline, pp) by the part of the step it comes from:")
    print(f"{'mode':>15} | " + " ".join(f"{p:>10}" for p in (*GAP_PARTS, "gap")))
    for mode, g in gaps.items():
        print(f"{mode:>15} | " + " ".join(f"{g[p]:+10.2f}" for p in (*GAP_PARTS, "gap")))
    print(f"wrote {out}/compare.csv and compare.json (commit {result['provenance']['commit']})")


PREDICTED_PARTS = ("step_time_s", "compute_s", "imbalance_wait_s", "grad_sync_s", "exchange_full_s", "exchange_sparse_s", "exchange_moe_s")
MEASURED_PARTS = (
    "step_time_s",
    "host_s",
    "forward_s",
    "backward_s",
    "grad_sync_s",
    "exchange_full_s",
    "exchange_sparse_s",
    "exchange_moe_s",
    "exchange_a2a_s",
)


def breakdown(pairs: list[tuple[dict, dict]]) -> dict[str, dict]:
    """Per mode, the mean of each predicted term (the simulator's; exchange_s = intra + inter comm,
    the exchange_*_s columns per site, waits included) and each measured phase (the driver's
    --timers columns) over paired_steps."""
    out = {}
    for mode in MODES:
        mine = [(s, m) for s, m in pairs if m["mode"] == mode]
        if not mine:
            continue
        pred = {k: float(np.mean([s[k] for s, _ in mine])) for k in PREDICTED_PARTS}
        pred["exchange_s"] = float(np.mean([s["intra_comm_s"] + s["inter_comm_s"] for s, _ in mine]))
        meas = {k: float(np.mean([m[k] for _, m in mine])) for k in MEASURED_PARTS}
        out[mode] = {"steps": len(mine), "predicted": pred, "measured": meas}
    return out


COMMAND = Command(
    "experiments.calibrate.emulate",
    __doc__,
    (ModelConfig, Cluster, WorkloadConfig, EmulateOptions),
    defaults={"model": "tiny", "cluster.gpus_per_node": 2, "workload.steps": 40},
    only={"model": (), "cluster": ("gpus_per_node",), "workload": ("steps", "seed")},
)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    module_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, module_args = argv[:i], argv[i + 1 :]
    s = entry.parse(COMMAND, argv, resolve_workload=False)  # resolved for the emulated cluster (run_compare)
    e = s.emulate
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still removes its namespaces
    why = unavailable()
    if why:
        print(f"emulated cluster unavailable: {why}", file=sys.stderr)
        sys.exit(3)
    try:
        if e.compare:
            run_compare(s)
            return
        if not module_args:
            entry.fail("give --compare or a module to run after '--' (e.g. -- -m experiments.calibrate --quick)")
        with EmulatedCluster(e.nodes, e.inter_mbit, e.burst_kb) as cluster:
            log_dir = os.path.join(os.path.abspath(e.out), "logs")
            os.makedirs(log_dir, exist_ok=True)
            codes = cluster.run(module_args, s.cluster.gpus_per_node, e.wall_limit, log_dir)
            print(open(os.path.join(log_dir, "node0.log")).read()[-4000:])
            print(f"return codes per node: {codes}; logs in {log_dir}")
            sys.exit(max(codes))
    except (*USER_ERRORS, RuntimeError) as err:  # the namespaces' set-up too: what the machine lacks, in one line
        entry.fail(err)


if __name__ == "__main__":
    main()
