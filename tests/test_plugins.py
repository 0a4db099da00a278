"""A user's own kind on every command line and rank (--plugin): the example plugin's FLOPs against
its mask (model.attention.check_sparse_flops, a check that fails on a wrong count), the ablation
with it in a fresh process, and four torchrun ranks of the driver, each importing it."""

import os
import subprocess
import sys

import pytest

from config import ModelConfig, SettingError
from config.cli import load_plugin
from tests.dist_utils import ROOT

PLUGIN = os.path.join(ROOT, "examples", "plugins", "strided.py")


@pytest.mark.parametrize("local, stride", [(8, 4), (3, 2), (1, 5), (4096, 64)])
def test_the_example_plugins_flops_count_the_pairs_its_mask_keeps(local, stride):
    load_plugin(PLUGIN)
    from model import check_sparse_flops

    check_sparse_flops(
        "strided", ModelConfig.from_name("tiny").replace(sparse_kind="strided", sparse_params={"local": local, "stride": stride})
    )


def test_the_flops_check_names_a_kind_whose_flops_price_another_pattern():
    """A strided mask registered with a sliding window's FLOPs: the check fails at the first
    length whose strided keys the window's count misses (7 tokens: 18 pairs counted, 22 kept)."""
    from model import check_sparse_flops, register_sparse_attention
    from solver import kinds
    from solver.cost import attention_flops, sliding_window_keys

    register_sparse_attention(
        "strided_mispriced",
        mask=lambda q, k, p: ((q - k) < p["local"]) | ((k + 1) % p["stride"] == 0),
        flops=lambda n, cfg: attention_flops(sliding_window_keys(n, cfg.sparse_params["local"]), cfg),
        params={"local": 3, "stride": 2},
        overwrite=True,
    )
    try:
        with pytest.raises(
            ValueError, match=r"'strided_mispriced': its flops count 18 \(query, key\) pairs for a sample of 7 tokens, its mask keeps 22"
        ):
            check_sparse_flops("strided_mispriced", ModelConfig.from_name("tiny"))
    finally:
        kinds._KINDS.pop("strided_mispriced")


def test_a_plugin_that_cannot_be_imported_is_one_line_naming_it(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('broken on purpose')\n")
    with pytest.raises(SettingError, match=r"--plugin '.*bad.py' cannot be imported: RuntimeError: broken on purpose"):
        load_plugin(str(bad))
    with pytest.raises(SettingError, match=r"--plugin 'no_such_module_here' cannot be imported: ModuleNotFoundError"):
        load_plugin("no_such_module_here")


def _run(*args, timeout=300):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_ablation_runs_a_kind_of_a_plugin_file_in_a_fresh_process(tmp_path):
    """A fresh interpreter has never imported the plugin: without --plugin the kind is refused
    in one line, with it the ablation plans and prices every mode it can (a kind without a reach
    runs no halo mode), and its summary records the plugin."""
    import json

    args = [
        "--sparse-kind",
        "strided",
        "--sparse-params",
        "local=1024",
        "stride=256",
        "--seeds",
        "1",
        "--steps",
        "30",
        "--no-progress",
        "--no-whole-run",
    ]
    refused = _run(sys.executable, "-m", "experiments.ablation", *args, "--out", str(tmp_path / "a"))
    assert refused.returncode == 2 and "'strided'" in refused.stderr and refused.stderr.strip().count("\n") == 0, refused.stderr
    p = _run(sys.executable, "-m", "experiments.ablation", "--plugin", PLUGIN, *args, "--out", str(tmp_path / "b"))
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.load(open(tmp_path / "b" / "summary.json"))
    assert summary["config"]["model"]["sparse_kind"] == "strided" and summary["config"]["plugins"] == [PLUGIN]
    assert "repack+solver" in summary["modes"] and "halo" not in summary["modes"]


@pytest.mark.slow
def test_four_torchrun_ranks_train_a_kind_of_a_plugin_file(tmp_path):
    """Each torchrun rank is a fresh interpreter that reads the command line, and so imports the
    plugin itself: every mode trains with the same loss."""
    import pandas as pd

    p = _run(
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "experiments.train",
        "--plugin", PLUGIN, "--sparse-kind", "strided", "--sparse-params", "local=8", "stride=4", "--gpus-per-node", "2",
        "--mode", "all", "--steps", "2", "--timeout", "120", "--out", str(tmp_path / "o"),
        timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    rows = pd.read_csv(tmp_path / "o" / "steps.csv")
    assert len(rows) > 0 and rows.groupby("step")["loss"].agg(lambda x: x.max() - x.min()).max() < 1e-5
