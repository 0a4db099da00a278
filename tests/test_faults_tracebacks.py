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
    _, summary = ablation.main(["--config", str(path), "--seeds", "1", "--steps", "5", "--out", str(tmp_path / "o"), "--no-progress"])
    assert summary["config"]["cluster"]["world_size"] == 32


@pytest.mark.parametrize(
    "main, args, message",
    [
        (memory_bench.main, ["--models", "bogus"], "--models='bogus' is invalid: it must be a comma-separated list from"),
        (kernel_bench.main, ["--head-dim", "-128"], "--head-dim=-128 is invalid: it must be an integer >= 1"),
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
    with pytest.raises(SystemExit, match=r"config file .*: model.n_kv_heads=0 is invalid: it must be an integer >= 1"):
        ablation.main(["--config", str(path), "--out", str(tmp_path / "o"), "--no-progress"])


def test_an_unwritable_output_is_refused_before_any_measurement(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit, match="is a file, not a folder"):
        kernel_bench.main(["--quick", "--out", str(blocker)])  # before half a minute of measuring
    assert report.main(["--docs", str(blocker)]) == 2


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
