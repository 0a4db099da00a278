"""Faults whose error once named a derived value or a missing key instead of the setting the user
gave: each now names the flag (or the file) and what would be valid."""

import json
import subprocess
import sys
import time

import pytest

import experiments.ablation.__main__ as ablation
from tests.dist_utils import ROOT


def _ablation(tmp_path, *args) -> str:
    with pytest.raises(SystemExit) as e:
        ablation.main(["--seeds", "1", "--steps", "5", *args, "--out", str(tmp_path / "o"), "--no-progress"])
    return str(e.value)


def test_a_fill_of_less_than_one_token_names_the_fill(tmp_path):
    assert "workload.fill (--fill)=1e-09 of 64 x 32768 tokens is less than one token a step" in _ablation(tmp_path, "--fill", "1e-9")


def test_a_negative_hidden_size_names_the_setting_not_a_sample(tmp_path):
    assert "--hidden=-4096 is invalid: it must be an integer in [1, 131072]" in _ablation(tmp_path, "--hidden", "-4096")


def test_a_nan_weight_decay_names_the_flag_not_a_disagreement_of_ranks(tmp_path, capsys):
    import experiments.train.__main__ as train

    with pytest.raises(SystemExit):
        train.main(["--weight-decay", "nan", "--out", str(tmp_path / "o")])
    assert "--weight-decay=nan is invalid: it must be a finite number in [0, 10]" in capsys.readouterr().err


def test_a_replay_of_a_summary_without_its_config_names_the_file(tmp_path):
    from experiments.common.errors import InputError
    from experiments.train.driver import replay_steps

    folder = tmp_path / "abl"
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"selected_steps": {"0": [1]}}))
    with pytest.raises(InputError, match=r"summary.json' is not an ablation's summary \(KeyError: 'config'\)"):
        replay_steps(str(folder))


@pytest.mark.slow
def test_a_model_that_cannot_fit_fails_with_the_memory_estimate_before_building_it(tmp_path):
    """The paper's model on one CPU process: the estimate's verdict in seconds, not an allocator
    error after building 119B parameters."""
    cmd = [sys.executable, "-m", "experiments.train", "--model", "paper", "--steps", "1", "--out", str(tmp_path / "o")]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and time.monotonic() - t0 < 60
    assert "model paper needs about" in p.stderr and "GiB per rank" in p.stderr and "this rank has" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize(
    "args, message",
    [
        (("--intra-node-bw", "1e-300"), "--intra-node-bw=1e-300 is invalid: it must be a finite number in [1000, 1e+15]"),
        (("--seed", str(2**70)), f"--seed={2**70} is invalid: it is beyond a 64-bit integer"),
        (("--sparse-params", f"window={2**63}"), f"window={2**63} is invalid; it takes an int > 0 and below 2^62"),
    ],
    ids=["bandwidth-1e-300", "seed-2^70", "window-2^63"],
)
def test_values_that_once_failed_far_from_their_setting_name_it(tmp_path, args, message):
    assert message in _ablation(tmp_path, *args)


def test_a_groups_bench_world_that_makes_no_whole_nodes_names_the_world_before_starting_ranks(tmp_path, monkeypatch):
    """--worlds 2 with nodes of 8 once started two ranks that each failed in a traceback."""
    import experiments.bench.groups as groups
    import experiments.common.local as local

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(local, "run_local", lambda *a, **k: pytest.fail("ranks started"))
    with pytest.raises(SystemExit) as e:
        groups.main(["--worlds", "8,2", "--out", str(tmp_path / "o")])
    assert "--worlds 8,2: 2 ranks do not make nodes of --gpus-per-node 8" in str(e.value)
