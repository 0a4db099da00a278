"""Workload generator and traces; the cross-rank plan-hash check."""

import json

import numpy as np
import pytest

from config import Cluster, HardwareConfig, ModelConfig, SettingError, WorkloadConfig
from experiments.common.errors import InputError
from experiments.common.workload import generate_steps, load_trace
from experiments.train.driver import agree_across_ranks
from model.distributed import LayoutInvariantError, check_same_plan, validate
from solver import CostModel, make_plan, samples_from_lengths
from tests.dist_utils import run_distributed


def test_generator_is_seeded_streams_whole_documents_and_has_long_ones():
    cfg = WorkloadConfig(tokens_per_step=1 << 20)
    a = generate_steps(cfg.replace(steps=50, seed=3))
    assert a == generate_steps(cfg.replace(steps=50, seed=3))
    assert a != generate_steps(cfg.replace(steps=50, seed=4))
    assert all(sum(s) <= cfg.tokens_per_step or len(s) == 1 for s in a)
    assert max(max(s) for s in generate_steps(cfg.replace(steps=200, seed=0))) >= cfg.long_min


def test_traces_in_every_format(tmp_path):
    (tmp_path / "t.csv").write_text("step,length\n1,5\n0,7\n0,3\n")
    (tmp_path / "t.jsonl").write_text('{"step": 1, "length": 5}\n{"step": 0, "length": 7}\n{"step": 0, "length": 3}\n')
    (tmp_path / "l.jsonl").write_text("[7, 3]\n[5]\n")
    np.save(tmp_path / "t.npy", np.array([[1, 5], [0, 7], [0, 3]]))
    for name in ("t.csv", "t.jsonl", "l.jsonl", "t.npy"):
        assert load_trace(str(tmp_path / name)) == [(0, [7, 3]), (1, [5])], name


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("a.csv", "step,length\n0,5,9\n", "expected 2 columns"),
        ("b.csv", "0,-4\n", "length -4"),
        ("c.jsonl", "{nope\n", "line 1: not JSON"),
        ("d.jsonl", '{"step": 0}\n', "expected {'step': int, 'length': int}"),
        ("e.txt", "0,5\n", "unknown extension '.txt'"),
        ("f.csv", "", "holds no samples"),
        ("g.csv", "0,2.5\n", "'2.5' is not an integer"),
    ],
)
def test_malformed_traces_are_clear_errors(tmp_path, name, text, match):
    (tmp_path / name).write_text(text)
    with pytest.raises(InputError, match=match):
        load_trace(str(tmp_path / name))


def _hash_body(rank, world):
    cost = CostModel(ModelConfig.from_name("tiny"), HardwareConfig())
    lengths = [30, 12, 7, 5] if rank != 2 else [30, 12, 7, 6]  # rank 2 computed a different batch
    plan = make_plan(samples_from_lengths(lengths), Cluster(world, 2, 32), cost, "repack")
    validate(plan, ModelConfig.from_name("tiny"), world)
    with pytest.raises(LayoutInvariantError, match="plan hash differs across ranks"):  # a bug, kept with its traceback
        check_same_plan(plan)
    check_same_plan(make_plan(samples_from_lengths([30, 12, 7, 5]), Cluster(world, 2, 32), cost, "repack"))  # agreeing: passes
    # the run's settings are compared once, before step 1: a rank started with another --seed is named
    fp = {"mode": "repack", "seed": 5 if rank == 3 else 0}
    with pytest.raises(SettingError, match="ranks disagree on seed: rank 0 has 0, rank 3 has 5"):
        agree_across_ranks(fp, world)
    agree_across_ranks({"mode": "repack", "seed": 0}, world)


@pytest.mark.slow
def test_plan_hash_or_run_settings_that_differ_across_ranks_fail_on_every_rank():
    run_distributed(_hash_body, 4)


def test_summary_json_is_plain_json(tmp_path):
    from experiments.common.results import summarize, write_run

    rows = [
        {"engine": "sim", "mode": m, "step": 0, "step_time_s": t, "mfu": 0.5, "lower_bound_s": 0.5}
        for m, t in (("baseline", 1.0), ("repack", 0.9))
    ]
    _, path = write_run(str(tmp_path), rows, {"modes": summarize(rows)})
    s = json.load(open(path))
    assert s["modes"]["repack"]["time_change_pct"] == pytest.approx(-10.0)
    assert s["modes"]["repack"]["captured_gain_frac"] == pytest.approx(0.2)
