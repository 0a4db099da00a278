"""Bad input to the entry points: a one-line error naming the value, before any work, and
nothing written. Each case was once silent, wrong or a traceback."""

import json
import math
import os

import numpy as np
import pytest

import experiments.ablation.__main__ as ablation
import experiments.train.__main__ as train
from experiments.ablation import sweep
from experiments.bench import solver as solver_bench
from experiments.common.errors import InputError
from experiments.common.results import read_run, write_run
from experiments.common.workload import load_trace
from solver import PlanError


def run_ablation_cli(tmp_path, *args):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        ablation.main(["--seeds", "1", "--steps", "5", *args, "--out", str(out), "--no-progress", "--no-whole-run"])
    assert not out.exists(), "a rejected run must write nothing"
    return str(e.value)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "--steps=0 is invalid"),
        (["--steps", "-5"], "--steps=-5 is invalid"),
        (["--seeds", "0"], "--seeds=0 is invalid"),
        (["--tokens-per-step", "0"], "--tokens-per-step=0 is invalid"),
        (["--tokens-per-step", "-100"], "--tokens-per-step=-100 is invalid"),
        (["--fill", "0"], "--fill=0.0 is invalid"),
        (["--fill", "1.5"], "--fill=1.5 is invalid"),
        (["--sparse-params", "window=0"], "window=0 is invalid"),
        (["--sparse-params", "window=-5"], "window=-5 is invalid"),
        (["--sparse-params", "window"], "--sparse-params 'window' is invalid: give KEY=VALUE pairs"),
        (["--long-prob", "-1"], "--long-prob=-1.0 is invalid"),
        (["--long-prob", "nan"], "--long-prob=nan is invalid"),
        (["--ratio", "inf"], "--ratio=inf is invalid"),
        (["--ratio", "0"], "--ratio=0.0 is invalid"),
        (["--sparse-kind", "chunked", "--sparse-params", "window=512"], "sparse kind 'chunked' has no parameter 'window'"),
        (["--sparse-kind", "nope"], "argument --sparse-kind: invalid choice: 'nope' (choose from "),
        (["--moe-overlap", "1.5"], "--moe-overlap=1.5 is invalid"),
        (["--ep", "0"], "--ep=0 is invalid"),
        (["--world-size", "12"], "cluster.world_size (--world-size)=12 is not a multiple of cluster.gpus_per_node (--gpus-per-node)=8"),
        (["--fill", "0.5", "--tokens-per-step", "1000"], "--fill and --tokens-per-step set the same thing two ways"),
        (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_flags_are_one_line_errors(tmp_path, args, message):
    err = run_ablation_cli(tmp_path, *args)
    assert message in err and "\n" not in err.strip()


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "does not exist"),
        ("{nope", "is not valid JSON"),
        ("48", "holds a int; it must be an object of sections"),
        ('{"model": [1, 2]}', "section 'model' is a list"),
        ('{"modle": {}}', "experiments.ablation reads no section 'modle'"),
        ('{"optim": {"lr": 1}}', "experiments.ablation reads no section 'optim'"),
        ('{"model": {"n_layer": 4}}', "model.n_layer is not a setting of experiments.ablation"),
        ('{"model": {"name": "x"}}', "model.name is not a setting of experiments.ablation"),
        ('{"model": {"n_layers": "48"}}', "model.n_layers='48' is invalid: it must be an integer, not str"),
        ('{"hardware": {"inter_intra_ratio": "7"}}', "hardware.inter_intra_ratio='7' is invalid: it must be a number, not str"),
        ('{"workload": {"seed": -1}}', "workload.seed=-1 is invalid"),
        ('{"model": {"preset": "huge"}}', "model.preset: unknown model preset 'huge'"),
        (
            '{"cluster": {"world_size": 12}}',
            "cluster.world_size (--world-size)=12 is not a multiple of cluster.gpus_per_node (--gpus-per-node)=8",
        ),
    ],
)
def test_bad_config_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "cfg.json"
    if content is not None:
        path.write_text(content)
    err = run_ablation_cli(tmp_path, "--config", str(path))
    assert message in err


def test_a_config_file_sets_the_workload_seed_and_steps(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"workload": {"seed": 3, "steps": 7}}))
    _, summary = ablation.main(["--config", str(path), "--seeds", "1", "--out", str(tmp_path / "o"), "--no-progress", "--no-whole-run"])
    assert summary["config"]["seeds"] == [3] and summary["config"]["workload"]["steps"] == 7


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("nan.csv", "0,nan\n", "'nan' is not an integer"),
        ("inf.csv", "0,inf\n", "'inf' is not an integer"),
        ("nan.jsonl", '{"step": 0, "length": NaN}\n', "nan is not an integer"),
        ("frac.jsonl", "[2.5]\n", "2.5 is not an integer"),
    ],
)
def test_non_integer_trace_lengths_are_errors(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(InputError, match=message):
        load_trace(str(tmp_path / name))


@pytest.mark.parametrize(
    "array, message",
    [
        (np.array([[0, 5], [0, np.nan]]), "nan is not an integer"),
        (np.array([[0, 2.5], [0, 3000.7]]), "2.5 is not an integer"),
        (np.array([[0, 5], [1, "x"]], dtype=object), "not a readable .npy array"),
    ],
    ids=["nan", "fractions", "objects"],
)
def test_npy_traces_with_nan_fractions_or_objects_are_errors(tmp_path, array, message):
    np.save(tmp_path / "t.npy", array, allow_pickle=True)
    with pytest.raises(InputError, match=message):
        load_trace(str(tmp_path / "t.npy"))


def test_a_trace_keeps_its_step_numbers(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("step,length\n100,300000\n100,5000\n" + "200,7000\n" * 20)
    assert load_trace(str(trace)) == [(100, [300000, 5000]), (200, [7000] * 20)]
    _, summary = ablation.main(["--trace", str(trace), "--out", str(tmp_path / "o"), "--no-progress", "--no-whole-run"])
    assert summary["selected_steps"] == {"0": [100]}


def test_an_output_path_that_is_a_file_is_refused_before_any_work(tmp_path):
    out = tmp_path / "file"
    out.write_text("keep me")
    for main, extra in ((ablation.main, ["--no-progress"]), (sweep.main, []), (solver_bench.main, ["--quick"])):
        with pytest.raises(SystemExit, match="is a file, not a folder"):
            main([*extra, "--out", str(out)])
    assert out.read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders; the check is the same one")
def test_a_read_only_output_folder_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    with pytest.raises(SystemExit, match="cannot be written"):
        ablation.main(["--out", str(ro / "x"), "--no-progress", "--no-whole-run"])


def test_a_batch_that_fits_is_placed():
    # 213 tokens on 8 ranks of 32: the 112-token sample's cost share asked for all 8 ranks,
    # leaving no room for the rest; the parent assignment narrows it to its memory floor and places all
    from config import Cluster, HardwareConfig, ModelConfig
    from solver import CostModel, make_plan, samples_from_lengths

    lengths = [112, 6, 6, 12, 10, 17, 3, 4, 3, 3, 3, 6, 7, 4, 14, 3]
    cost = CostModel(ModelConfig.from_name("tiny"), HardwareConfig())
    for mode in ("baseline", "repack", "repack+solver", "baseline+solver"):
        plan = make_plan(samples_from_lengths(lengths), Cluster(8, 2, 32), cost, mode)
        assert sorted(s for p in plan.parents for s in p.group.samples) == list(range(len(lengths)))


def test_the_results_reader_keeps_non_finite_values(tmp_path):
    rows = [
        {"engine": "torch", "mode": "baseline", "step": 0, "step_time_s": 1.5, "mfu": 0.1, "loss": float("nan"), "plan_hash": "ab"},
        {"engine": "torch", "mode": "baseline", "step": 1, "step_time_s": 1.5, "mfu": 0.1, "loss": float("inf"), "plan_hash": "cd"},
    ]
    write_run(str(tmp_path), rows, {"engine": "torch"})
    got, _ = read_run(str(tmp_path))
    assert math.isnan(got[0]["loss"]) and got[1]["loss"] == math.inf and got[0]["step"] == 0 and got[0]["lower_bound_s"] is None


def test_every_registered_sparse_kind_runs_with_its_declared_defaults(tmp_path):
    _, summary = ablation.main(
        ["--sparse-kind", "chunked", "--seeds", "1", "--steps", "5", "--out", str(tmp_path / "o"), "--no-progress", "--no-whole-run"]
    )
    assert summary["config"]["model"]["sparse_params"] == {"chunk": 8192}


def test_the_model_and_every_step_are_checked_against_the_cluster_before_step_1():
    """check_setup refuses, naming the setting, what the planner would refuse at some later step;
    where it allows a set-up, the planner places every step of it."""
    from config import Cluster, HardwareConfig, ModelConfig, SettingError
    from solver import CostModel, check_setup, make_plan, samples_from_lengths

    tiny = CostModel(ModelConfig.from_name("tiny"), HardwareConfig())  # 8 query / 8 KV heads
    gqa = CostModel(ModelConfig.from_name("tiny-gqa"), HardwareConfig())  # 8 query / 2 KV heads
    cluster = Cluster(16, 2, 32)
    assert "groups up to SP8;" in check_setup(cluster, tiny)
    assert "key/value heads replicated on groups wider than SP2" in check_setup(cluster, gqa)
    with pytest.raises(SettingError, match=r"gpus_per_node=16: node-local children may be SP16, .* at most SP8"):
        check_setup(Cluster(16, 16, 32), tiny)
    with pytest.raises(SettingError, match=r"gpus_per_node=16"):  # the planner refuses it too
        make_plan(samples_from_lengths([40, 8]), Cluster(16, 16, 32), tiny, "repack")
    # a sample of 257 tokens needs SP16 at 32 tokens per rank; the 8 heads allow SP8: step 3 says so
    steps = [(0, [256, 100]), (3, [257, 8])]
    with pytest.raises(PlanError, match=r"step 3: a sample of 257 tokens needs SP16 .* up to SP8 .* tokens_per_rank >= 33"):
        check_setup(cluster, tiny, steps)
    with pytest.raises(PlanError, match=r"ranks x tokens_per_rank=32\); use tokens_per_rank >= 33"):
        check_setup(cluster, tiny, [(0, [256] * 2 + [10])])
    for mode in ("baseline", "repack", "repack+solver", "baseline+solver"):  # what it allows is planned, SP8 at most
        plan = make_plan(samples_from_lengths(steps[0][1]), cluster, tiny, mode)
        assert plan.widest_parent == 8


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "--steps=0 is invalid: it must be an integer in [1, 10000000]"),
        (["--save-every", "-1"], "--save-every=-1 is invalid: it must be an integer in [0, 10000000]"),
        (["--timeout", "0"], "--timeout=0.0 is invalid: it must be a finite number in (0, 86400]"),
        (["--world-size", "8"], "unrecognized arguments: --world-size 8"),
        (["--lr", "nan"], "--lr=nan is invalid"),
        (["--resume-step", "-2"], "--resume-step=-2 is invalid"),
        (["--tokens-per-rank", "0"], "--tokens-per-rank=0 is invalid"),
        (["--repeats", "0", "--mode", "all"], "--repeats=0 is invalid: it must be an integer in [1, 10000]"),
        (["--repeats", "2"], "--repeats=2 needs --mode all"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_driver_flags_are_one_line_errors_before_any_work(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        train.main([*args, "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists() or not any(out.iterdir())


def test_unwritable_driver_folders_are_refused_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for flag, extra in (("--out", []), ("--ckpt-dir", ["--save-every", "2"])):
        with pytest.raises(SystemExit):
            train.main([flag, str(blocker), *extra] + (["--out", str(tmp_path / "o")] if flag != "--out" else []))
        assert f"{flag} '{blocker}' is a file, not a folder" in capsys.readouterr().err
