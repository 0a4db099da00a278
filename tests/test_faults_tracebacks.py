"""Faults that once ended in a traceback: each is now one line naming the file or the setting, and a
damaged checkpoint falls back to the newest good one."""

import json
import os
import pickle
import shutil

import pytest

import experiments.ablation.__main__ as ablation
import experiments.bench.kernels as kernel_bench
import experiments.bench.memory as memory_bench
import experiments.report.__main__ as report
import experiments.train.__main__ as train
from experiments.train import checkpoint
from experiments.train.checkpoint import CheckpointError
from tests.dist_utils import run_distributed
from tests.test_checkpoints import CFG, Boom, _model_and_opt, _nothing, _rewrite_manifest, _train_a_step


def test_a_valid_world_size_in_a_config_file_is_taken(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"cluster": {"world_size": 32}}))
    _, summary = ablation.main(
        ["--config", str(path), "--seeds", "1", "--steps", "5", "--out", str(tmp_path / "o"), "--no-progress", "--no-whole-run"]
    )
    assert summary["config"]["cluster"]["world_size"] == 32


@pytest.mark.parametrize(
    "main, args, message",
    [
        (memory_bench.main, ["--models", "bogus"], "--models='bogus' is invalid: it must be a comma-separated list from"),
        (kernel_bench.main, ["--head-dim", "-128"], "--head-dim=-128 is invalid: it must be an integer in [1, 4096]"),
        (kernel_bench.main, ["--n-heads", "0"], "--n-heads=0 is invalid"),
        (train.main, ["--timeout", "1e15"], "--timeout=1000000000000000.0 is invalid: it must be a finite number in (0, 86400]"),
    ],
    ids=["memory-model", "kernel-head-dim", "kernel-heads", "train-timeout"],
)
def test_bad_flags_of_every_entry_point_are_one_line(capsys, main, args, message):
    with pytest.raises(SystemExit) as e:
        main(args)
    text = str(e.value.code) if isinstance(e.value.code, str) else capsys.readouterr().err
    assert message in text and text.strip().count("\n") == 0, text


def test_a_config_with_no_key_value_heads_is_one_line(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": {"n_kv_heads": 0}}))
    with pytest.raises(SystemExit, match=r"config file .*: model.n_kv_heads=0 is invalid: it must be an integer in \[1, 4096\]"):
        ablation.main(["--config", str(path), "--out", str(tmp_path / "o"), "--no-progress", "--no-whole-run"])


def test_an_unwritable_output_is_refused_before_any_measurement(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit, match="is a file, not a folder"):
        kernel_bench.main(["--quick", "--out", str(blocker)])  # before half a minute of measuring
    with pytest.raises(SystemExit) as exit_:
        report.main(["--docs", str(blocker)])
    assert exit_.value.code == 2  # a user's error, as every entry point's


def _defects_body(rank, world, root):
    """Four defects in the newest checkpoint, each written so it passes the manifest (or is the
    manifest): each is one line naming the file, --resume falls back to the one before, and
    --resume-step on it is that line."""
    import torch.distributed as dist

    meta = {"model": CFG.to_dict(), "fingerprint": {"seed": 0}, "scheduler": {}, "rows": []}
    expect = {"world_size": world, "model": CFG.to_dict(), "fingerprint": {"seed": 0}}
    marker = os.path.join(root, "pwned")
    ck = os.path.join(root, "ck")
    model, opt = _model_and_opt()
    _train_a_step(model, opt, 1)
    checkpoint.save(ck, 2, model, opt, meta)

    def damaged(how, match):
        """Save step 4 afresh, damage it on rank 0 (`how(folder)`), and load."""
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(ck, "step_0000004"), ignore_errors=True)
        dist.barrier()
        checkpoint.save(ck, 4, model, opt, meta)
        if rank == 0:
            how(os.path.join(ck, "step_0000004"))
        dist.barrier()
        with pytest.raises(CheckpointError, match=match) as e:
            checkpoint.load(ck, *_model_and_opt(), expect, step=4)
        assert "\n" not in str(e.value), str(e.value)
        warned = pytest.warns(UserWarning, match="step_0000004 is unusable") if rank == 0 else _nothing()
        with warned:
            assert checkpoint.load(ck, *_model_and_opt(), expect)["step"] == 2  # the newest good one

    # the crafted item must be saved by every rank (DCP's save is collective): done before the damage
    dist.barrier()
    m, o = _model_and_opt()
    o.param_groups[0]["lr"] = Boom(marker)
    checkpoint.save(os.path.join(root, "crafted"), 4, m, o, meta)
    dist.barrier()

    def take_crafted(folder):
        shutil.rmtree(folder)
        shutil.copytree(os.path.join(root, "crafted", "step_0000004"), folder)

    damaged(take_crafted, r"item 'optim.param_groups.0.lr' is not plain data \(UnpicklingError")
    assert not os.path.exists(marker)

    def truncated_shard(folder):
        with open(os.path.join(folder, "__0_0.distcp"), "r+b") as fh:
            fh.truncate(300)
        _rewrite_manifest(folder)

    damaged(truncated_shard, r"__0_0.distcp' cannot be read")

    def truncated_second_shard(folder):  # named as itself, not as the intact first shard read beside it
        with open(os.path.join(folder, "__1_0.distcp"), "r+b") as fh:
            fh.truncate(300)
        _rewrite_manifest(folder)

    damaged(truncated_second_shard, r"__1_0.distcp' cannot be read")

    def manifest_shape(folder):
        with open(os.path.join(folder, checkpoint.MANIFEST), "w") as fh:
            json.dump(["not", "a", "manifest"], fh)

    damaged(manifest_shape, r"manifest.json' is not a manifest")

    def binary_rng(folder):
        with open(os.path.join(folder, "rng_rank0.json"), "wb") as fh:
            fh.write(pickle.dumps(object) + b"\xff\xfe")
        _rewrite_manifest(folder)

    damaged(binary_rng, r"rng_rank0.json' is not readable JSON \(UnicodeDecodeError")


@pytest.mark.slow
def test_every_checkpoint_defect_is_one_line_naming_the_file_and_resume_falls_back(tmp_path):
    run_distributed(_defects_body, 2, str(tmp_path))


@pytest.mark.parametrize(
    "config, message",
    [
        ({"hardware": {"preset": 5}}, "hardware.preset: 5 is invalid: a preset is a name (a string), one of ['h100', 'h200']"),
        ({"model": {"preset": ["tiny"]}}, "model.preset: ['tiny'] is invalid: a preset is a name (a string)"),
        ({"model": {"n_layers": 10**29}}, f"model.n_layers={10**29} is invalid: it is beyond a 64-bit integer"),
        (
            {"model": {"sparse_params": {"window": 10**23}}},
            "window=100000000000000000000000 is invalid; it takes an int > 0 and below 2^62",
        ),
    ],
    ids=["preset-int", "preset-list", "huge-int", "huge-window"],
)
def test_config_values_of_the_wrong_type_or_beyond_int64_are_one_line(tmp_path, config, message):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:
        ablation.main(["--config", str(path), "--out", str(tmp_path / "o"), "--no-progress", "--no-whole-run"])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def _doc(tmp_path, body: str):
    docs = tmp_path / "docs"
    docs.mkdir(exist_ok=True)
    (docs / "a.md").write_text(body)
    return docs


def test_report_over_results_it_cannot_render_is_one_line_and_writes_no_doc(tmp_path, capsys):
    """A training run's folder where the ablation's should be, an ablation that selected no step (a
    valid output: the notebook loader says the same), a summary that is a JSON list, a steps.csv of
    non-UTF-8 bytes, a marker that names no renderer: each one line naming it, every doc unchanged."""
    from experiments.common.errors import InputError
    from experiments.common.results import write_run
    from experiments.report.plots import load_or_run_ablation

    results = tmp_path / "results"
    ablation.main(["--seeds", "1", "--steps", "2", "--out", str(results / "none"), "--no-progress", "--no-whole-run"])  # selects no step
    write_run(str(results / "train"), [{"engine": "torch", "mode": "baseline", "step": 0}], {"engine": "torch"})
    write_run(str(results / "list"), [], {})
    (results / "list" / "summary.json").write_text("[1, 2]")
    write_run(str(results / "bytes"), [], {"engine": "sim"})
    with open(results / "bytes" / "steps.csv", "ab") as f:
        f.write(b"\xff\xfe\x00")
    cases = {
        "none": "the ablation selected no step (none of its 2 steps for seeds [0] has a parent wider than a node)",
        "train": "holds the results of engine 'torch' (the training driver's, python -m experiments.train), not an ablation's",
        "list": "summary.json holds a JSON list; a run's summary is an object",
        "bytes": "steps.csv is not the one",
    }
    for folder, message in cases.items():
        body = f"hand text\n<!-- report:ablation {folder} -->\nold\n<!-- /report -->\n"
        docs = _doc(tmp_path, body)
        with pytest.raises(SystemExit) as exit_:
            report.main(["--docs", str(docs), "--results", str(results)])
        assert exit_.value.code == 2  # a user's error, as every entry point's
        err = capsys.readouterr().err
        assert message in err and "line 2, block ablation" in err and err.strip().count("\n") == 0, err
        assert (docs / "a.md").read_text() == body
    with pytest.raises(InputError, match="the ablation selected no step"):
        load_or_run_ablation(str(results / "none"))
    docs = _doc(tmp_path, "<!-- report:ablatoin none -->\nold\n<!-- /report -->\n")
    with pytest.raises(SystemExit) as exit_:
        report.main(["--docs", str(docs), "--results", str(results)])
    assert exit_.value.code == 2  # a user's error, as every entry point's
    assert "a.md line 1: report:ablatoin names no renderer; renderers: ['ablation'" in capsys.readouterr().err


def test_results_and_checkpoints_on_a_full_disk_are_one_line_and_keep_what_was_there(small_disk, tmp_path, capsys):
    """The ablation refuses an --out without room for its results before running; results that no
    longer fit when written are one line, the old ones kept whole."""
    from experiments.common.errors import InputError
    from experiments.common.results import read_run, write_run

    with pytest.raises(SystemExit, match=r"--out .* has 0.\d MiB free on its disk, and the run writes about 8.8 MiB there"):
        ablation.main(["--steps", "200", "--out", str(small_disk / "o"), "--no-progress", "--no-whole-run"])
    rows = [{"engine": "sim", "mode": "baseline", "step": s, "step_time_s": 1.0, "mfu": 0.1} for s in range(3)]
    write_run(str(small_disk / "r"), rows, {"engine": "sim"})
    with pytest.raises(InputError, match=r"cannot be written to .* \(No space left on device\); what was there is unchanged"):
        write_run(str(small_disk / "r"), rows * 20000, {"engine": "sim"})
    assert len(read_run(str(small_disk / "r"))[0]) == 3 and sorted(os.listdir(small_disk / "r")) == ["steps.csv", "summary.json"]


def _full_disk_body(rank, world, root, disk):
    meta = {"model": CFG.to_dict(), "fingerprint": {}, "scheduler": {}, "rows": []}
    model, opt = _model_and_opt()
    _train_a_step(model, opt, 1)
    with pytest.raises(CheckpointError, match=r"cannot be written: .*\(the disk is full: \d+ bytes free\); it was removed") as e:
        checkpoint.save(os.path.join(disk, "ck"), 2, model, opt, meta)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_a_checkpoint_on_a_full_disk_is_one_line_saying_so(small_disk, tmp_path):
    run_distributed(_full_disk_body, 2, str(tmp_path), str(small_disk))
    assert os.listdir(small_disk / "ck") == []  # the partial checkpoint removed, no `latest`


@pytest.mark.parametrize("entry_point", ["ablation", "train"])
def test_a_lengths_file_holding_an_integer_past_2_to_the_63_is_one_line_naming_file_and_line(tmp_path, capsys, entry_point):
    path = tmp_path / "l.txt"
    path.write_text("12\n" + "9" * 23 + "\n")
    main = ablation.main if entry_point == "ablation" else train.main
    with pytest.raises(SystemExit) as e:
        main(["--lengths", str(path), "--out", str(tmp_path / "o"), *(["--no-progress"] if entry_point == "ablation" else [])])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert f"--lengths: lengths file '{path}' line 2: {'9' * 23} is longer than any supported cluster holds" in err
