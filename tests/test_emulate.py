"""The emulated two-tier cluster (experiments.emulate): namespaces made and always removed; the
simulated-vs-measured comparison. The full --compare run is a benchmark (README), not a test."""

import subprocess

import pytest

from experiments.calibrate.emulate import EmulatedCluster, compare, paired_steps, unavailable
from experiments.common.results import write_run

WHY = unavailable()


@pytest.mark.skipif(WHY is not None, reason=f"emulated cluster unavailable here: {WHY}")
def test_namespaces_and_links_are_removed_even_when_the_run_fails():
    def ours():
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in out.splitlines() if line.startswith(("lrhub", "lrn"))]

    before = ours()
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(2, 100) as cluster:
            made = ours()
            assert set(cluster.names) | {cluster.hub} <= set(made)
            # the link is rate-limited both ways
            qd = subprocess.run(
                ["ip", "netns", "exec", cluster.names[0], "tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
            )
            assert "tbf" in qd.stdout and "100Mbit" in qd.stdout
            raise RuntimeError("boom")
    assert ours() == before


@pytest.mark.slow
@pytest.mark.skipif(WHY is not None, reason=f"emulated cluster unavailable here: {WHY}")
def test_an_interrupted_run_leaves_no_launcher_behind(tmp_path):
    """A run stopped from outside (Ctrl-C, or SIGTERM, which the entry point turns into an exit)
    kills every node's launcher: each runs in a session of its own, which no signal to the
    emulation reaches."""
    import os
    import signal
    import time

    def interrupt(*_):
        raise KeyboardInterrupt

    def launchers(port_tag):
        out = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
        return [line for line in out.splitlines() if port_tag in line and "torch.distributed.run" in line]

    tag = f"--rdzv-id=lr{29400 + os.getpid() % 500}"
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with EmulatedCluster(2, 100) as cluster:
            signal.alarm(2)
            with pytest.raises(KeyboardInterrupt):
                cluster.run(["--no-python", "sleep", "120"], 1, 600, str(tmp_path))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    time.sleep(0.5)
    assert launchers(tag) == []


def test_the_comparison_joins_steps_and_modes_and_reports_changes(tmp_path):
    def run(folder, engine, times):
        rows = [
            {"engine": engine, "mode": m, "step": s, "step_time_s": t, "mfu": 0.1, "plan_hash": f"{m}{s}"} for (s, m), t in times.items()
        ]
        write_run(str(tmp_path / folder), rows, {"modes": {}})

    run("sim", "sim", {(0, "baseline"): 1.0, (0, "repack"): 0.8, (1, "baseline"): 2.0, (1, "repack"): 1.8})
    run("meas", "torch", {(0, "baseline"): 2.0, (0, "repack"): 1.0, (1, "baseline"): 4.0, (1, "repack"): 4.0})
    rows, summary = compare(paired_steps(str(tmp_path / "sim"), str(tmp_path / "meas")))
    assert len(rows) == 4 and all(r["same_plan"] for r in rows)
    assert summary["baseline"]["median_abs_rel_error_pct"] == pytest.approx(50.0)
    r = summary["repack"]
    assert r["predicted_change_pct"] == pytest.approx(-15.0)  # mean of -20% and -10%
    assert r["measured_change_pct"] == pytest.approx(-25.0)  # mean of -50% and 0%
    assert r["change_gap_pp"] == pytest.approx(10.0) and r["worst_abs_rel_error_pct"] == pytest.approx(55.0)


def test_several_runs_render_each_gap_and_their_median(tmp_path):
    """The emulated-runs block: per mode each run's change vs baseline and gap, and the median of
    the gaps (signed, and of their size), beside what each run's calibration fitted."""
    import json

    from config import HardwareConfig
    from experiments.report.tables import emulated_runs

    def run(k, gap, halo):
        folder = tmp_path / f"run{k}"
        (folder / "calibrate").mkdir(parents=True)
        mode = {"steps": 3, "median_abs_rel_error_pct": 10.0 + k, "predicted_change_pct": -5.0, "same_plans": True}
        modes = {"baseline": {**mode, "measured_change_pct": 0.0, "change_gap_pp": 0.0}}
        modes["repack"] = {**mode, "measured_change_pct": -5.0 - gap, "change_gap_pp": gap}
        cluster = {"nodes": 4, "ranks_per_node": 2, "inter_mbit": 800.0}
        (folder / "compare.json").write_text(json.dumps({"modes": modes, "cluster": cluster, "model": "tiny-gdn", "provenance": {}}))
        hw = HardwareConfig(a2a_latency=4e-3, halo_latency=halo, linear_block_latency=1e-3).to_dict()
        (folder / "calibrate" / "profile.json").write_text(json.dumps({"hardware": hw}))
        return str(folder)

    text, prov = emulated_runs(run(1, 3.0, 1e-3), run(2, -1.0, 6e-3), run(3, 0.5, 2e-3))
    repack = next(line for line in text.splitlines() if line.startswith("| repack"))
    assert "-5.0% vs -8.0%, -5.0% vs -4.0%, -5.0% vs -5.5%" in repack
    assert "| +3.0, -1.0, +0.5 | +0.5 (1.0) | 11%, 12%, 13% |" in repack
    assert "3 runs, 4 emulated nodes x 2 gloo ranks, 800 Mbit/s between nodes, the tiny-gdn model." in text
    assert "run 2: ratio 7.00x (group), all-to-all call 4.0 ms, halo call 6.0 ms, 1.00 ms per recurrence block" in text
    assert len(prov) == 3 and "| baseline" not in text
