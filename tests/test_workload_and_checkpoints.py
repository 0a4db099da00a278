"""Workload generator and traces; the cross-rank plan-hash check."""

import gzip
import json

import numpy as np
import pytest

from config import Cluster, HardwareConfig, ModelConfig, SettingError, WorkloadConfig
from experiments.common.errors import InputError
from experiments.common.lengths import distribution, read_lengths
from experiments.common.workload import generate_steps, load_trace
from experiments.train.driver import agree_across_ranks
from model.distributed import LayoutInvariantError, check_same_plan, validate
from solver import CostModel, PlanError, make_plan, samples_from_lengths
from tests.dist_utils import run_distributed


def test_generator_is_seeded_streams_whole_documents_and_has_long_ones():
    cfg = WorkloadConfig(tokens_per_step=1 << 20)
    a = generate_steps(cfg.replace(steps=50, seed=3))
    assert a == generate_steps(cfg.replace(steps=50, seed=3))
    assert a != generate_steps(cfg.replace(steps=50, seed=4))
    assert all(sum(s) <= cfg.tokens_per_step or len(s) == 1 for s in a)
    assert max(max(s) for s in generate_steps(cfg.replace(steps=200, seed=0))) >= cfg.long_min


def test_the_shipped_wikipedia_lengths_hold_flexsps_published_statistics():
    """The shipped histogram against the figures published with the data (1,000,000 documents,
    median 347, mean 1,014, longest 1,823,777; above 32K: 0.13% of documents, 7.6% of tokens;
    above 128K: 0.0049% and 1.1%): the conversion kept every length."""
    values, cumulative = distribution("flexsp-wikipedia")
    lengths = np.repeat(values, np.diff(cumulative, prepend=0))
    assert len(lengths) == 1_000_000 and np.median(lengths) == 347 and round(lengths.mean()) == 1014 and lengths.max() == 1_823_777
    # the published percentages to the digits given: within half a unit of their last digit
    for above, docs, tokens in ((32768, (0.13, 0.005), (7.6, 0.05)), (131072, (0.0049, 0.00005), (1.1, 0.05))):
        assert 100 * (lengths > above).mean() == pytest.approx(docs[0], abs=docs[1])
        assert 100 * lengths[lengths > above].sum() / lengths.sum() == pytest.approx(tokens[0], abs=tokens[1])


def test_a_length_distribution_is_drawn_seeded_and_streamed_whole(tmp_path):
    """A user's file (gzipped here) and the shipped preset: the same seed the same steps; every
    document one of the file's lengths, whole; the draws follow the file's frequencies."""
    path = tmp_path / "l.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write("5\n\n9\n5\n2000\n")
    cfg = WorkloadConfig(lengths=str(path), tokens_per_step=100, steps=400)
    a = generate_steps(cfg.replace(seed=1))
    assert a == generate_steps(cfg.replace(seed=1)) and a != generate_steps(cfg.replace(seed=2))
    docs = [n for s in a for n in s]
    assert set(docs) == {5, 9, 2000}
    assert all(sum(s) <= 100 or len(s) == 1 for s in a)  # a document that would overflow a step opens the next, whole
    assert docs.count(5) / len(docs) == pytest.approx(0.5, abs=0.05)  # two of the file's four lengths
    wiki = WorkloadConfig.from_name("flexsp-wikipedia", steps=20).for_cluster(Cluster())
    steps = generate_steps(wiki)
    assert len(steps) == 20 and steps == generate_steps(wiki)
    assert set(n for s in steps for n in s) <= set(distribution("flexsp-wikipedia")[0].tolist())


def test_a_document_longer_than_the_widest_group_is_an_error_naming_it_unless_clipped(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text("10\n5000\n")
    cluster = Cluster(8, 2, 100)  # the widest group holds 800 tokens
    cfg = WorkloadConfig(lengths=str(path), tokens_per_step=700, steps=5, seed=0).for_cluster(cluster)
    cost = CostModel(ModelConfig.from_name("tiny"), HardwareConfig())
    step = next(s for s in generate_steps(cfg) if 5000 in s)
    with pytest.raises(PlanError, match=r"length=5000 .*tokens_per_rank=100"):
        make_plan(samples_from_lengths(step), cluster, cost, "baseline")
    widest = cost.for_cluster(cluster).widest_group(cluster) * cluster.tokens_per_rank
    clipped = generate_steps(cfg.replace(clip_to_cluster=True).clipped(widest))
    assert max(n for s in clipped for n in s) == widest


@pytest.mark.parametrize(
    "text, match",
    [("5\n7.5\n", r"line 2: '7\.5' is not a length"), ("5\n\n0\n", r"line 3: '0' is not a length"), ("\n\n", "holds no length")],
)
def test_a_malformed_lengths_file_is_an_error_naming_the_line(tmp_path, text, match):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(InputError, match=match):
        read_lengths(str(path))


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
