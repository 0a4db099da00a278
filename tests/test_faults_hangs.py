"""Faults that once hung: a stopped rank, settings that made a solver spin, a workload generated
whole before any check. Each now ends, in a bounded time, with a line that says why."""

import json
import os
import signal
import subprocess
import time

import pytest

import experiments.ablation.__main__ as ablation
import experiments.train.__main__ as train
from tests.dist_utils import ROOT, forked_driver, torchrun_cmd


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return sorted(int(p) for p in out.stdout.split())


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_timeout_naming_it(tmp_path):
    """SIGSTOP one of 2 ranks after a step has run: every collective (the exchanges' groups and
    FSDP's, not only the default group's) times out after --timeout, the live rank names the one
    that did not time out with it, and torchrun ends the job (its --shutdown-timeout is how long it
    waits for the stopped process before killing it)."""
    timeout, wait = 5, 5  # wait: how long a timed-out rank listens for the others
    cmd = torchrun_cmd(2, "--steps", "40", "--timeout", str(timeout), "--tokens-per-rank", "64", "--out", str(tmp_path / "o"))
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stopped, reported = None, []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            if "step     1" in p.stdout.readline():  # a step has run: the groups are made and in use
                break
        workers = _children(p.pid)
        assert len(workers) == 2, workers
        stopped = workers[-1]  # local rank 1
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        for line in p.stderr:  # rank 0's report, within the timeout and the listening
            reported.append(line)
            if "[rank 0] failed:" in line:
                break
        took = time.monotonic() - t0
        # torchrun now stops the job: it signals the stopped process, and kills it after its grace
        # (30 s); let it take the signal at once, so the test does not wait the grace out
        os.kill(stopped, signal.SIGCONT)
        p.wait(timeout=60)
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    err = "".join(reported)
    assert p.returncode != 0
    assert "[rank 0] failed:" in err and "rank(s) [1] did not time out with the others: stopped, stuck or gone" in err, err[-3000:]
    assert took < timeout + wait + 15, took  # the timeout and the listening: nothing waits on the stopped rank


def test_a_latency_that_would_make_the_solver_spin_is_refused(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"hardware": {"a2a_latency": 1e308}}))
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match=r"hardware.a2a_latency=1e\+308 is invalid: it must be a finite number in \[0, 60\]"):
        ablation.main(["--config", str(path), "--out", str(tmp_path / "o"), "--no-progress", "--no-whole-run"])
    assert time.monotonic() - t0 < 10


def test_a_token_budget_no_rank_can_hold_is_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(["--tokens-per-rank", "1000000000000", "--out", str(tmp_path / "o")])
    assert "--tokens-per-rank=1000000000000 is invalid: it must be an integer in [1, 16777216]" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_of_ten_million_steps_starts_at_once(tmp_path):
    """The generated workload is made step by step as the run reaches it, checked from its
    settings up front: a run of 1e7 steps (the most a run takes) starts, runs its first step and stops."""
    t0 = time.monotonic()
    p = forked_driver(1, "--steps", "10000000", "--stop-after", "1", "--tokens-per-rank", "64", "--out", str(tmp_path / "o"))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "step     0" in p.stdout and time.monotonic() - t0 < 120


@pytest.mark.parametrize(
    "args",
    [("--world-size", str(2**17), "--steps", "20"), ("--tokens-per-step", str(2 * 10**12), "--steps", "1")],
    ids=["world-2^17", "batch-2e12"],
)
def test_a_workload_too_big_to_generate_is_refused_before_generating(tmp_path, args):
    """At the bounds of the world and the batch (config.cluster), a workload too big to draw in
    minutes is refused before any document is drawn."""
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        ablation.main([*args, "--out", str(tmp_path / "o"), "--no-progress", "--no-whole-run"])
    assert "documents" in str(e.value) and "more than the 20,000,000 the generator draws in minutes" in str(e.value), str(e.value)
    assert time.monotonic() - t0 < 20  # the generation of these would take hours
