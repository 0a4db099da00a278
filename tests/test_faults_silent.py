"""Faults that once ran to completion and reported something wrong: a setting unchecked on one route,
an expert-parallel degree the cluster cannot hold, a data file changed in the middle, a nan loss
called a success, results files that disagree, a mean that skips a nan."""

import json
import math

import numpy as np
import pandas as pd
import pytest

import experiments.ablation.__main__ as ablation
from config import Cluster, CostsConfig, HardwareConfig, ModelConfig, SettingError
from experiments.common.errors import InputError
from experiments.common.files import file_identity
from experiments.common.results import read_run, write_run
from experiments.report.plots import mode_means
from solver import CostModel
from tests.dist_utils import forked_driver


def _ablation(tmp_path, *args) -> str:
    with pytest.raises(SystemExit) as e:
        ablation.main(["--seeds", "1", "--steps", "5", *args, "--out", str(tmp_path / "o"), "--no-progress", "--no-whole-run"])
    assert not (tmp_path / "o").exists(), "a rejected run writes nothing"
    return str(e.value)


@pytest.mark.parametrize(
    "section, values, message",
    [
        ("model", {"n_layers": 0}, "model.n_layers=0 is invalid"),
        ("model", {"n_heads": 0}, "model.n_heads=0 is invalid"),
        ("model", {"head_dim": 0}, "model.head_dim=0 is invalid"),
        ("model", {"top_k": 0}, "model.top_k=0 is invalid"),
        ("hardware", {"bytes_per_element": 0}, "hardware.bytes_per_element=0 is invalid"),
        ("hardware", {"bytes_per_element": -2}, "hardware.bytes_per_element=-2 is invalid"),
        ("hardware", {"inter_intra_ratio": 1e308}, "hardware.inter_intra_ratio=1e+308 is invalid"),
        ("hardware", {"a2a_latency": 1e308}, "hardware.a2a_latency=1e+308 is invalid"),
        ("costs", {"moe_overlap": 2}, "costs.moe_overlap=2 is invalid"),
    ],
)
def test_a_setting_is_checked_in_a_config_file_with_the_flags_limits(tmp_path, section, values, message):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({section: values}))
    assert message in _ablation(tmp_path, "--config", str(path))


def test_a_hardware_profile_is_checked_and_an_empty_one_is_no_preset(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"hardware": {}}))
    assert "the profile lacks" in _ablation(tmp_path, "--hardware", str(empty))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hardware": {**HardwareConfig().to_dict(), "bytes_per_element": 0}}))
    message = _ablation(tmp_path, "--hardware", str(bad))
    assert "hardware profile" in message and "bytes_per_element=0 is invalid" in message


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ep", "3"], "--ep=3 is invalid: it must be a power of two"),
        (["--ep", "1000"], "--ep=1000 is invalid: it must be a power of two"),
        (["--ep", "16"], "costs.ep_degree (--ep)=16 is wider than a node of 8 ranks"),
        (["--ep", "256"], "costs.ep_degree (--ep)=256 does not divide model.n_experts (--n-experts)=128"),
    ],
)
def test_the_expert_parallel_degree_is_checked_against_the_cluster_and_the_experts(tmp_path, args, message):
    assert message in _ablation(tmp_path, *args)


def test_the_expert_parallel_degree_defaults_to_what_the_node_and_the_experts_hold():
    tiny = ModelConfig.from_name("tiny")  # 4 experts
    assert CostModel(tiny, HardwareConfig()).for_cluster(Cluster(8, 2, 32)).ep_degree == 2  # a node of 2
    assert CostModel(tiny, HardwareConfig()).for_cluster(Cluster(16, 8, 32)).ep_degree == 4  # at most the experts
    paper = CostModel(ModelConfig.from_name("paper"), HardwareConfig())
    assert paper.ep_degree == 8 and paper.for_cluster(Cluster()).ep_degree == 8  # the paper's EP8
    inter = CostModel(tiny, HardwareConfig(), costs=CostsConfig(ep_placement="inter", ep_degree=4)).for_cluster(Cluster(8, 2, 32))
    assert inter.ep_degree == 4  # across nodes: wider than a node is what it means
    with pytest.raises(SettingError, match=r"--ep\)=4 is wider than a node of 2 ranks"):
        CostModel(tiny, HardwareConfig(), costs=CostsConfig(ep_degree=4)).for_cluster(Cluster(8, 2, 32))


def test_a_data_file_changed_in_the_middle_is_another_file(tmp_path):
    path = tmp_path / "t.csv"
    text = "step,length\n" + "".join(f"{k // 50},{1000 + k}\n" for k in range(200_000))  # several MiB
    path.write_text(text)
    before = file_identity(str(path))
    middle = len(text) // 2
    path.write_text(text[:middle] + ("9" if text[middle] != "9" else "8") + text[middle + 1 :])  # same size
    after = file_identity(str(path))
    assert before["bytes"] == after["bytes"] and before["sha256"] != after["sha256"]


def test_a_results_folder_cut_short_or_torn_between_two_runs_is_refused(tmp_path, monkeypatch):
    import os

    from experiments.common.results import summarize

    rows = [{"engine": "sim", "mode": m, "step": s, "step_time_s": 1.0, "mfu": 0.1} for s in range(3) for m in ("baseline", "repack")]
    write_run(str(tmp_path), rows, {"modes": summarize(rows)})
    assert len(read_run(str(tmp_path))[0]) == 6
    lines = (tmp_path / "steps.csv").read_text().splitlines(keepends=True)
    (tmp_path / "steps.csv").write_text("".join(lines[:-2]))  # two whole rows gone, at a row boundary
    with pytest.raises(InputError, match=r"steps.csv is not the one .*summary.json was written with"):
        read_run(str(tmp_path))
    # a second run that dies between its two renames: its steps.csv beside the first run's summary
    write_run(str(tmp_path), rows, {"modes": summarize(rows)})
    renames, real = [], os.replace

    def dies_at_the_second(src, dst):
        renames.append(dst)
        if len(renames) == 2:
            raise KeyboardInterrupt  # the process ends here
        real(src, dst)

    monkeypatch.setattr(os, "replace", dies_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        write_run(str(tmp_path), rows[:4], {"modes": summarize(rows[:4])})
    monkeypatch.undo()
    with pytest.raises(InputError, match=r"the two files are of different runs"):
        read_run(str(tmp_path))


def test_the_headline_counts_its_seeds_and_a_floored_fit_is_said(tmp_path, capsys):
    import os

    from experiments.report.tables import headline

    ablation.main(["--seeds", "2", "--steps", "30", "--out", str(tmp_path / "a"), "--no-progress", "--no-whole-run"])
    text, _ = headline(str(tmp_path / "a"))
    assert "mean over 2 seeds)" in text and "5 seeds" not in text
    summary = json.load(open(tmp_path / "a" / "summary.json"))
    counts = ", ".join(str(len(v)) for v in summary["selected_steps"].values())
    assert f"over the steps with SP16/32 parents ({counts} of 30 steps, per seed" in text  # how many steps the figures cover
    # a calibration that fitted the halo call's latency at 0: the ablation's header says it is priced free
    profile = {"hardware": {**HardwareConfig().to_dict(), "halo_latency": 0.0, "floored": ["halo_latency"]}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    capsys.readouterr()
    ablation.main(
        ["--hardware", str(path), "--seeds", "1", "--steps", "3", "--out", str(tmp_path / "b"), "--no-progress", "--no-whole-run"]
    )
    out = capsys.readouterr().out
    assert "the calibration fitted halo_latency at the floor of its range (0)" in out and "priced free" in out
    assert os.path.exists(tmp_path / "b" / "summary.json")


def test_summary_json_is_strict_json_and_keeps_a_nan_loss(tmp_path):
    rows = [{"engine": "torch", "mode": "baseline", "step": 0, "step_time_s": 1.0, "mfu": 0.1, "loss": float("nan")}]
    from experiments.common.results import summarize

    _, path = write_run(str(tmp_path), rows, {"modes": summarize(rows), "worst": float("inf")})

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    summary = json.loads(open(path).read(), parse_constant=refuse)  # a strict parser
    assert summary["modes"]["baseline"]["mean_loss"] == "nan" and summary["worst"] == "inf"
    got, _ = read_run(str(tmp_path))
    assert math.isnan(got[0]["loss"])


def test_the_notebooks_mean_loss_keeps_a_nan_step():
    df = pd.DataFrame({"mode": ["repack"] * 3, "step_time_s": [1.0, 2.0, 3.0], "mfu": [0.1] * 3, "loss": [4.0, np.nan, 4.2]})
    assert math.isnan(mode_means(df).loc["repack", "loss"]) and mode_means(df).loc["repack", "step_time_s"] == 2.0


@pytest.mark.slow
def test_a_nan_loss_fails_the_run_naming_its_step_unless_asked_to_go_on(tmp_path):
    # an aux-loss weight that overflows the loss to inf at step 0: the run stops there, its
    # results so far written, exit non-zero; with --allow-nonfinite it runs every step
    args = ("--aux-loss-coef", "1e308", "--steps", "3", "--tokens-per-rank", "64")
    p = forked_driver(1, *args, "--out", str(tmp_path / "stop"))
    assert p.returncode != 0
    assert "failed: NonFiniteLoss: step 0 (repack+solver): the loss is inf; the run stops here" in p.stderr
    rows, _ = read_run(str(tmp_path / "stop"))
    assert [r["step"] for r in rows] == [0]
    p = forked_driver(1, *args, "--allow-nonfinite", "--out", str(tmp_path / "go"))
    assert p.returncode == 0, p.stderr[-2000:]
    assert [r["step"] for r in read_run(str(tmp_path / "go"))[0]] == [0, 1, 2]


@pytest.mark.slow
def test_a_step_of_one_token_samples_has_no_loss_and_fails_naming_it(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("step,length\n0,5\n0,3\n1,1\n1,1\n")
    p = forked_driver(1, "--trace", str(trace), "--steps", "2", "--out", str(tmp_path / "o"))
    assert p.returncode != 0
    assert "step 1: every sample is one token long, so the step has no next-token label and no loss" in p.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tokens-per-rank", "0"], "--tokens-per-rank=0 is invalid: it must be an integer in [1, 16777216]"),
        (["--tokens-per-rank", "-5"], "--tokens-per-rank=-5 is invalid"),
        (["--gpu-gib", "nan"], "--gpu-gib=nan is invalid: it must be a finite number in (0, 1e+06]"),
    ],
)
def test_the_memory_table_refuses_what_it_cannot_estimate(args, message):
    import experiments.bench.memory as memory_bench

    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("(", r"\(").replace("+", r"\+")):
        memory_bench.main(args)


def _refused(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def test_document_offsets_without_a_token_file_are_refused_not_ignored(tmp_path, capsys):
    import experiments.train.__main__ as train

    offsets = tmp_path / "o.npy"
    np.save(offsets, np.array([0, 3, 7], dtype=np.int64))
    err = _refused(train.main, ["--doc-offsets", str(offsets), "--out", str(tmp_path / "o")], capsys)
    assert "--doc-offsets is not read: it gives the document boundaries of a token file, and no --tokens is given" in err


@pytest.mark.parametrize("flag", ["--trace", "--lengths"])
def test_a_token_file_with_a_trace_or_lengths_is_refused_naming_the_one_not_read(tmp_path, capsys, flag):
    import experiments.train.__main__ as train

    np.save(tmp_path / "t.npy", np.arange(8, dtype=np.uint16))
    np.save(tmp_path / "o.npy", np.array([0, 3, 8], dtype=np.int64))
    (tmp_path / "t.csv").write_text("step,length\n0,3\n")
    (tmp_path / "l.txt").write_text("3\n")
    other = str(tmp_path / ("t.csv" if flag == "--trace" else "l.txt"))
    argv = ["--tokens", str(tmp_path / "t.npy"), "--doc-offsets", str(tmp_path / "o.npy"), flag, other, "--out", str(tmp_path / "o")]
    err = _refused(train.main, argv, capsys)
    assert f"{flag} is not read: --tokens='{tmp_path / 't.npy'}' gives this run's documents" in err


@pytest.mark.parametrize(
    "text, key",
    [
        ('{"workload": {"steps": 3}, "model": {}, "workload": {"steps": 4}}', "'workload'"),
        ('{"model": {"sparse_params": {"window": 8, "window": 16}}}', "model.sparse_params.'window'"),
    ],
    ids=["section", "nested"],
)
def test_a_config_file_with_a_key_given_twice_is_refused_naming_it(tmp_path, text, key):
    path = tmp_path / "c.json"
    path.write_text(text)
    assert f"config file '{path}': key {key} is given twice in one object" in _ablation(tmp_path, "--config", str(path))


def test_a_hardware_profile_with_a_key_given_twice_is_refused(tmp_path):
    path = tmp_path / "p.json"
    body = json.dumps({"hardware": HardwareConfig().to_dict()})
    path.write_text(body[:-2] + ', "bytes_per_element": 4}}')
    assert "key hardware.'bytes_per_element' is given twice in one object" in _ablation(tmp_path, "--hardware", str(path))


@pytest.mark.parametrize("flag", ["--n-experts", "--hidden", "--expert-ffn", "--vocab", "--n-heads"])
def test_the_simulator_refuses_a_model_shape_of_2_to_the_62(tmp_path, flag):
    assert f"{flag}=4611686018427387904 is invalid: it must be an integer in [1, " in _ablation(tmp_path, flag, str(2**62))


def test_the_simulator_refuses_shapes_each_in_bounds_that_no_cluster_could_train(tmp_path):
    """Each shape within its own bound, together a model whose memory estimate exceeds any
    accelerator's on the widest supported cluster: refused before it is priced, naming them."""
    message = _ablation(tmp_path, "--n-experts", "16384", "--expert-ffn", "262144", "--hidden", "131072")
    assert "model paper as set (--expert-ffn, --hidden, --n-experts) needs about" in message
    assert "no supported cluster could train it" in message


def test_every_numeric_setting_has_an_upper_bound_its_check_enforces():
    """Every integer and number setting of every section (the entry points' own too) declares its
    largest valid value, and its check takes that value and refuses the next one up: no route can
    give a value past it to any of them."""
    import inspect

    import config
    import config.entries as entries
    from config.base import Section

    sections = {
        c for m in (config, entries) for _, c in inspect.getmembers(m, inspect.isclass) if issubclass(c, Section) and c is not Section
    }
    checked = 0
    for cls in sections:
        for name, f in cls.settings().items():
            kind, check = f.metadata["type"], f.metadata["check"]
            if kind not in (int, float):
                continue
            assert check is not None and check.hi is not None, f"{cls.SECTION}.{name} has no upper bound"
            above = check.hi + 1 if kind is int else check.hi * 2 + 1
            assert check.ok(check.hi) or kind is float, f"{cls.SECTION}.{name}: its bound is not a valid value"
            assert not check.ok(above), f"{cls.SECTION}.{name} takes {above}, past its bound {check.hi}"
            assert kind is float or check.hi < 2**63, f"{cls.SECTION}.{name}: an integer past int64"
            checked += 1
    assert checked > 60
