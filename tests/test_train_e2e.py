"""The training driver end to end: gloo ranks in emulated nodes, tiny model, under torchrun where
the launcher is part of what is tested, else forked from the test (tests/dist_utils.forked_driver)."""

import os
import subprocess

import numpy as np
import pytest

from experiments.common.errors import InputError
from experiments.common.results import read_run
from experiments.train.data import TokenFileSource, load_offsets
from solver.modes import MODES
from tests.dist_utils import ROOT, forked_driver, single_rank_cmd, torchrun
from tests.test_gpu import BF16_LOSS_RTOL


def losses(folder):
    rows, _ = read_run(folder)
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.slow
def test_every_mode_same_losses_in_fp32_and_bf16_and_results_parse(tmp_path):
    # one step in every mode (no optimizer updates between them): the same losses. 2 ranks in
    # nodes of 1 (a quarter of the start-up of 8): the parent assignment puts the step's three
    # samples in one SP2 parent, which spans two nodes, and repack gives each rank whole samples.
    # --timers: the phases and exchanges timed (results unchanged)
    trace = tmp_path / "step.csv"
    trace.write_text("step,length\n0,62\n0,40\n0,20\n")
    one_step = ("--gpus-per-node", "1", "--tokens-per-rank", "64", "--trace", str(trace), "--mode", "all", "--steps", "1")
    p = torchrun(2, *one_step, "--timers", "--out", str(tmp_path / "all"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "loss" in p.stdout and "MFU" in p.stdout
    rows, summary = read_run(str(tmp_path / "all"))
    assert summary["engine"] == "torch" and summary["provenance"]["commit"]
    assert sorted({r["mode"] for r in rows}) == sorted(MODES) and len(rows) == len(MODES)
    assert all(r["engine"] == "torch" for r in rows)
    by = {(r["step"], r["mode"]): r["loss"] for r in rows}
    for step in range(1):
        for mode in MODES[1:]:
            np.testing.assert_allclose(by[(step, mode)], by[(step, "baseline")], rtol=1e-5)
    assert any(r["wide_parents"] > 0 for r in rows), "some step must have a parent across emulated nodes"
    assert any(r["repacked_parents"] > 0 for r in rows if r["mode"] == "repack"), "and repack must repack it"
    # the GPU's dtype on gloo: bf16 (FSDP2's bf16 parameters with fp32 reduction, or autocast when
    # replicated; the exchanges move bf16, every collective gloo runs has bf16). Every mode's loss
    # within BF16_LOSS_RTOL of the fp32 run's (bf16 keeps 8 bits: a unit roundoff of 2^-8 = 0.4%
    # per rounding, averaged over the step's tokens; measured here 0.01-0.1%), and the modes agree
    # within a quarter of that roundoff (the exchanges only move elements, but a rank's bf16 GEMMs
    # over another number of rows can round differently; measured here up to 1.1e-4)
    # (the replicated path's bf16 autocast: tests/test_model_distributed.py)
    out = tmp_path / "bf16"
    p = forked_driver(2, *one_step, "--dtype", "bf16", "--out", str(out))  # the launcher's start tested once, above
    assert p.returncode == 0, p.stderr[-3000:]
    bf = {(r["step"], r["mode"]): r["loss"] for r in read_run(str(out))[0]}
    assert bf.keys() == by.keys()
    for key, loss in bf.items():
        np.testing.assert_allclose(loss, by[key], rtol=BF16_LOSS_RTOL, err_msg=str(key))
        np.testing.assert_allclose(loss, bf[(key[0], "baseline")], rtol=1e-3, err_msg=str(key))
    for r in rows:  # each rank's phases lie inside its step, timed apart: their means fit in the slowest step
        phases = r["host_s"] + r["forward_s"] + r["backward_s"] + r["grad_sync_s"]
        assert 0 < r["forward_s"] and 0 < r["backward_s"] and phases <= r["step_time_s"], r
        exchanges = r["exchange_full_s"] + r["exchange_sparse_s"]
        assert r["exchange_a2a_s"] <= exchanges <= r["forward_s"] + r["backward_s"], r
        assert (r["exchange_a2a_s"] > 0) == (r["widest_parent"] > 1), r  # a plan of single ranks exchanges nothing


def _resume_matches(root, ranks, layout, resumed_layout=None):
    """Train 4 steps checkpointed every 2, resume from step 2: the resumed steps' losses equal the
    uninterrupted run's exactly; resumed_layout: also resume under those flags (another EP degree,
    sharding), the same losses within float32's accumulated rounding."""
    budget = ("--tokens-per-rank", "64", "--mode", "repack+solver", "--steps", "4")
    ck = root / "ck"
    p = forked_driver(ranks, *budget, *layout, "--save-every", "2", "--ckpt-dir", str(ck), "--out", str(root / "full"))
    assert p.returncode == 0, p.stderr[-3000:]
    full = losses(root / "full")
    assert sorted(full) == [0, 1, 2, 3]
    assert sorted(os.listdir(ck)) == ["latest", "step_0000002", "step_0000004"]  # no torn .tmp folders
    (ck / "latest").write_text("step_0000002")
    p = forked_driver(ranks, *budget, *layout, "--ckpt-dir", str(ck), "--resume", "--out", str(root / "resumed"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from step 2 ({ck / 'step_0000002'})" in p.stdout, p.stdout[-2000:]  # the log names its step and checkpoint
    assert losses(root / "resumed") == full
    if resumed_layout is not None:
        p = forked_driver(ranks, *budget, *resumed_layout, "--ckpt-dir", str(ck), "--resume", "--out", str(root / "relaid"))
        assert p.returncode == 0, p.stderr[-3000:]
        assert "resumed a checkpoint written at EP" in p.stdout
        got = losses(root / "relaid")
        assert got.keys() == full.keys()
        np.testing.assert_allclose([got[k] for k in sorted(got)], [full[k] for k in sorted(full)], rtol=1e-6)


@pytest.mark.slow
def test_resume_under_expert_parallelism_inside_a_node_is_exact_and_resumes_at_another_degree(tmp_path):
    # training with updates, checkpointed every 2 steps, then resumed from the step-2 checkpoint (as
    # after an interruption there): exactly the uninterrupted losses of steps 3 and 4 on CPU.
    # 2 ranks in a node of 2: the default EP degree is a node's (EP2 inside the node), with
    # replicated parameters (the experts' gradients summed over their replicas); resumed exactly,
    # then at EP1 under FSDP2 (every expert read from the whole layer's tensors). Writing and
    # reading under FSDP2 at EP2 and EP4, and every pair of degrees: tests/test_checkpoints.py, bit
    # for bit; the experts across nodes: tests/test_experts_distributed.py
    _resume_matches(tmp_path, 2, ("--gpus-per-node", "2", "--shard", "none"), ("--gpus-per-node", "2", "--ep", "1", "--shard", "fsdp"))


@pytest.mark.slow
def test_a_sample_too_long_for_the_cluster_fails_before_step_1_with_its_reason(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("step,length\n0,10\n1,10\n1,100000\n")
    p = forked_driver(1, "--trace", str(trace), "--steps", "2", "--out", str(tmp_path / "o"))
    assert p.returncode != 0
    assert f"failed: PlanError: --trace='{trace}': step 1: a sample of 100000 tokens needs SP4096 at tokens_per_rank=32" in p.stderr
    assert "use tokens_per_rank >= 100000" in p.stderr and "--tokens-per-rank" in p.stderr
    assert " loss " not in p.stdout, "no step may run"


@pytest.mark.slow
def test_plain_single_rank_runs_side_by_side_all_finish(tmp_path):
    """A plain `python -m experiments.train` (no launcher) takes no network port: two at once on
    one machine (as a notebook and a sweep script, or two users, start them) both train their
    step and write their results, neither refused an address the other holds."""
    cmds = [single_rank_cmd("--steps", "1", "--out", str(tmp_path / f"o{k}")) for k in range(2)]
    procs = [subprocess.Popen(c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    outs = [p.communicate(timeout=120) for p in procs]
    for k, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err[-2000:]
        assert sorted(losses(tmp_path / f"o{k}")) == [0]


def test_corrupt_token_files_are_clear_errors(tmp_path):
    toks = tmp_path / "tok.npy"
    np.save(toks, np.arange(20, dtype=np.uint16))
    offs = tmp_path / "off.npy"
    np.save(offs, np.array([0, 8, 5, 20]))
    with pytest.raises(InputError, match="decrease at index 1"):
        load_offsets(str(offs), 20)
    np.save(offs, np.array([0, 8, 19]))
    with pytest.raises(InputError, match="must start at 0 and end at the token count 20"):
        load_offsets(str(offs), 20)
    np.save(toks, np.arange(20, dtype=np.float32))
    np.save(offs, np.array([0, 8, 20]))
    with pytest.raises(InputError, match="expected a 1-D uint16 or uint32 array"):
        TokenFileSource(str(toks), str(offs), 100, 97)
    np.save(toks, np.arange(120, 140, dtype=np.uint32))
    with pytest.raises(InputError, match="token id 139 >= the model's vocab 97"):
        TokenFileSource(str(toks), str(offs), 100, 97)
    (tmp_path / "junk.npy").write_bytes(b"not an array")
    with pytest.raises(InputError, match="not a readable .npy array"):
        TokenFileSource(str(tmp_path / "junk.npy"), str(offs), 100, 97)


@pytest.mark.slow
def test_a_corrupt_token_file_ends_the_run_with_its_reason(tmp_path):
    (tmp_path / "junk.npy").write_bytes(b"not an array")
    np.save(tmp_path / "off.npy", np.array([0, 8, 20]))
    p = forked_driver(1, "--tokens", str(tmp_path / "junk.npy"), "--doc-offsets", str(tmp_path / "off.npy"), "--out", str(tmp_path / "o"))
    assert p.returncode != 0 and "not a readable .npy array" in p.stderr


def test_token_file_steps_hold_whole_documents(tmp_path):
    toks = tmp_path / "tok.npy"
    np.save(toks, np.arange(50, dtype=np.uint16))
    offs = tmp_path / "off.npy"
    np.save(offs, np.array([0, 10, 25, 26, 50]))
    src = TokenFileSource(str(toks), str(offs), 30, 97)
    assert [src.get(i).lengths for i in range(len(src))] == [[10, 15, 1], [24]]
    assert src.get(1).tokens[0].tolist() == list(range(26, 50))


@pytest.mark.slow
def test_eight_ranks_hold_only_the_process_groups_their_plans_use(tmp_path):
    import math

    from config import Cluster, CostsConfig, HardwareConfig, ModelConfig, PlannerConfig, WorkloadConfig
    from experiments.common.workload import generate_steps
    from model.distributed import expert_groups
    from solver import CostModel, make_plan, samples_from_lengths

    # nodes of 2 and a budget that makes SP4 and SP8 parents: every width of the world is used by some rank
    p = forked_driver(8, "--tokens-per-rank", "12", "--mode", "repack+solver", "--steps", "3", "--out", str(tmp_path / "o"))
    assert p.returncode == 0, p.stderr[-3000:]
    rows, summary = read_run(str(tmp_path / "o"))
    cfg, groups = summary["config"], summary["process_groups"]
    # the yardstick: the run's plans made again here, from its settings
    cluster = Cluster(**cfg["cluster"])
    cost = CostModel(ModelConfig(**cfg["model"]), HardwareConfig(**cfg["hardware"]), costs=CostsConfig(**cfg["costs"])).for_cluster(cluster)
    pricing = PlannerConfig(**cfg["planner"]).assignment_pricing
    plans = [
        make_plan(samples_from_lengths(lengths), cluster, cost, "repack+solver", pricing)
        for lengths in generate_steps(WorkloadConfig(**cfg["workload"]))
    ]
    assert sorted(p.hash for p in plans) == sorted(r["plan_hash"] for r in rows)
    used = set().union(*(p.group_shapes for p in plans), expert_groups(cfg["costs"]["ep_degree"], 8))  # EP2 by default: nodes of 2
    widest = max(size for _, size in used)
    assert widest == 8, "the run must use a group of every rank"
    assert groups["new_group_calls"] == len(used)
    for r, held in enumerate(groups["held"]):
        mine = {(s, n) for s, n in used if s <= r < s + n}
        assert {tuple(g) for g in held} == mine, f"rank {r}"
        assert len(held) <= math.log2(widest)
