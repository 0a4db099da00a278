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
        ablation.main(["--seeds", "1", "--steps", "5", *args, "--out", str(tmp_path / "o"), "--no-progress", "--no-whole-run"])
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


def test_a_lengths_file_that_is_a_folder_is_called_a_folder(tmp_path):
    assert f"--lengths: lengths file '{tmp_path}' is a folder: give a file of lengths" in _ablation(tmp_path, "--lengths", str(tmp_path))


@pytest.mark.slow
def test_a_length_distribution_too_long_for_the_cluster_names_its_route_not_the_mixture(tmp_path, capsys):
    import experiments.train.__main__ as train
    from tests.dist_utils import forked_driver

    p = forked_driver(1, "--workload", "flexsp-wikipedia", "--steps", "2", "--out", str(tmp_path / "o"))
    assert p.returncode != 0
    assert "the workload's documents reach 1823777 tokens (--workload flexsp-wikipedia's workload.lengths='flexsp-wikipedia')" in p.stderr
    assert "--long-max" not in p.stderr
    del train


@pytest.mark.parametrize("length", ["9" * 23, "9" * 13])
def test_a_huge_length_in_a_csv_trace_is_shown_as_given_with_the_trace_named(tmp_path, length):
    trace = tmp_path / "t.csv"
    trace.write_text(f"step,length\n0,{length}\n")
    with pytest.raises(SystemExit) as e:
        ablation.main(["--trace", str(trace), "--out", str(tmp_path / "o"), "--no-progress", "--no-whole-run"])
    message = str(e.value)
    assert length in message, message  # exactly as written, not through a float
    assert f"'{trace}'" in message  # the trace named: at its line, or as the run's source of the step
    if len(length) == 23:
        assert f"trace '{trace}' line 2: {length} is beyond a 64-bit integer" in message
    else:
        assert f"--trace='{trace}' step 0: sample id=0 of length={length} cannot be placed" in message


def test_a_folder_lock_names_the_process_that_holds_it_and_its_command(tmp_path):
    from tests.test_faults_data_loss import _Holder

    out = tmp_path / "o"
    holder = _Holder(out)
    try:
        with pytest.raises(SystemExit) as e:
            ablation.main(["--seeds", "1", "--steps", "3", "--out", str(out), "--no-progress", "--no-whole-run"])
    finally:
        holder.close()
    assert f"is in use by another run (process {holder.p.pid} holds its lock: {sys.executable} -c " in str(e.value)


@pytest.mark.parametrize("module", ["experiments.ablation.__main__", "experiments.ablation.sweep"])
def test_mode_is_not_read_as_an_abbreviation_of_model(module, capsys):
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(["--mode", "bogus"])
    assert "unrecognized arguments: --mode bogus" in str(e.value)
    assert "model preset" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_replay_of_an_ep4_ablation_on_one_rank_names_the_replay_not_the_ep_flag(tmp_path):
    from tests.dist_utils import forked_driver

    abl = tmp_path / "abl"
    ablation.main(["--ep", "4", "--seeds", "1", "--steps", "40", "--out", str(abl), "--no-progress", "--no-whole-run"])
    p = forked_driver(1, "--replay", str(abl), "--mode", "all", "--model", "paper", "--out", str(tmp_path / "o"))
    assert p.returncode != 0
    assert f"costs.ep_degree (--replay '{abl}': the ablation's costs.ep_degree)=4 is wider than a node of 1 ranks" in p.stderr
    assert "(--ep)" not in p.stderr


def test_the_sweeps_state_factor_on_an_attention_model_is_refused_before_it_starts(tmp_path):
    import experiments.ablation.sweep as sweep

    with pytest.raises(SystemExit) as e:
        sweep.main(["--factors", "fill,state", "--out", str(tmp_path / "o")])
    assert "--factors='fill,state': factor 'state' sets the sparse kind's 'head_k_dim', and model paper's kind 'sliding_window'" in str(
        e.value
    )
    assert not (tmp_path / "o").exists()
