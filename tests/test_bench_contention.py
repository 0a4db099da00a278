"""The contention bench (experiments.bench.contention): the steps it times put the extra samples on
the ranks each way names, the simulator prices those steps as dedicated devices run them, and a
run on local gloo ranks writes rows the report renders."""

import csv

import pytest

from config import HardwareConfig, ModelConfig
from experiments.bench import contention
from experiments.common.steps import runtime_step_plan
from experiments.report.tables import contention_bench
from solver import CostModel
from solver.simulator import simulate


@pytest.mark.parametrize(
    "world, node, expected",
    [
        (8, 2, {contention.EVERY: tuple(range(8)), contention.PER_NODE: (0, 2, 4, 6), contention.ONE: (0,)}),
        (8, 8, {contention.EVERY: tuple(range(8)), contention.ONE: (0,)}),  # one node: its first rank is rank 0
        (4, 1, {contention.EVERY: (0, 1, 2, 3), contention.ONE: (0,)}),  # nodes of one rank: each node's first is every rank
        (2, 2, {contention.EVERY: (0, 1), contention.ONE: (0,)}),
    ],
)
def test_each_way_loads_the_ranks_it_names_and_no_way_repeats_another(world, node, expected):
    assert contention.ways(world, node) == expected


@pytest.mark.parametrize("size", [1, 2])
def test_a_runtime_step_plan_holds_each_groups_own_sample_count(size):
    counts = (5, 1, 3, 1) if size == 2 else (5, 1, 3, 1, 1, 1, 2, 1)
    plan = runtime_step_plan(8, 2, size, 4, samples=counts)
    held = [len(p.group.samples) for p in sorted(plan.parents, key=lambda p: p.group.start)]
    assert held == list(counts)
    every = sorted(s for p in plan.parents for s in p.group.samples)
    assert every == list(range(sum(counts)))  # each sample in one group, once
    assert all(n == 4 * size for _, n in plan.lengths)
    with pytest.raises(ValueError, match=r"3 sample counts for 4 groups of 2 ranks"):
        runtime_step_plan(8, 2, 2, 4, samples=(1, 2, 3))


def test_the_simulator_prices_a_sample_on_one_rank_as_on_every_rank():
    """Dedicated devices: the loaded rank is the slowest, so whether the others loop over the same
    samples does not change the step's price (what the bench measures does, on shared cores)."""
    cost = CostModel(ModelConfig.from_name("tiny"), HardwareConfig(attention_sample_latency=1e-3), 2)
    price = {way: simulate(runtime_step_plan(8, 2, 1, 2, samples=tuple(16 if r in ranks else 1 for r in range(8))), cost).step_time
             for way, ranks in contention.ways(8, 2).items()}  # fmt: skip
    one = simulate(runtime_step_plan(8, 2, 1, 2), cost).step_time
    assert price[contention.EVERY] > one
    assert price[contention.PER_NODE] == pytest.approx(price[contention.EVERY], rel=1e-12)
    assert price[contention.ONE] == pytest.approx(price[contention.EVERY], rel=1e-12)


def test_a_run_on_local_ranks_writes_a_row_per_way_that_the_report_renders(tmp_path, capsys):
    contention.main(["--worlds", "2", "--rounds", "1", "--samples", "2", "--out", str(tmp_path)])
    path = tmp_path / "contention_bench.csv"
    rows = list(csv.DictReader(open(path)))
    assert [(r["way"], int(r["loaded_ranks"])) for r in rows] == [(contention.EVERY, 2), (contention.ONE, 1)]
    assert len({r["base_ms"] for r in rows}) == 1  # every way against the one step of one sample a rank
    assert all(r["commit"] and r["device"] for r in rows)  # the provenance of the run, on every row
    assert float(rows[0]["vs_every_rank"]) == 1.0
    text, prov = contention_bench(str(path))
    for r in rows:
        assert f"| {r['way']} | {r['loaded_ranks']} x 2 | {float(r['base_ms']):.1f} | {float(r['added_ms']):.1f} |" in text
    assert prov[0]["command"] == rows[0]["command"]
