"""The exchanges' process groups at start-up: how many each rank holds and how long making them takes.

    python -m experiments.bench.groups                     # 8, 16 and 64 local gloo ranks
    python -m experiments.bench.groups --worlds 8,16       # fewer
    torchrun ... -m experiments.bench.groups               # the ranks at hand (e.g. the emulated cluster:
        python -m experiments.calibrate.emulate --nodes 4 --gpus-per-node 2 -- -m experiments.bench.groups)

Two ways on the same ranks, one after the other:
- every aligned group made up front (every rank calling new_group for each of the world's W - 1
  aligned groups, as the runtime did before it made groups lazily);
- the groups the default workload's first --steps steps (200) use in every mode, made as the steps reach
  them (kernels.exchange.ExchangeGroups, what the training driver does).
For each: seconds spent making groups (the slowest rank), the groups a rank holds (the most and
the fewest over ranks) and the new_group calls every rank made. Rank 0 plans the steps and sends
every rank their groups. Writes <out>/groups_bench.csv (a row per world size and way).
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from config import Cluster, HardwareConfig, ModelConfig, WorkloadConfig
from config.cli import Command, Settings
from config.entries import GroupsBenchOptions
from experiments.common import entry
from experiments.common.files import check_output_dir
from experiments.common.local import measure_ranks, write_rows
from experiments.common.provenance import provenance
from experiments.common.settings import prepare
from experiments.common.workload import generate_steps
from kernels.exchange import ExchangeGroups
from solver import CostModel, PlanError, make_plan, samples_from_lengths
from solver.modes import MODES

COMMAND = Command(
    "experiments.bench.groups",
    __doc__,
    (ModelConfig, HardwareConfig, Cluster, WorkloadConfig, GroupsBenchOptions),
    only={"model": (), "hardware": (), "cluster": ("gpus_per_node", "tokens_per_rank"), "workload": ("seed", "steps")},
    defaults={"workload.steps": 200},
    exclude=frozenset({"cluster.world_size"}),
)


def used_groups(settings: Settings, world: int, steps: int) -> list[frozenset]:
    """The group shapes of each of the first `steps` steps' plans in every mode, in step order."""
    s = prepare(settings.replace(cluster=settings.cluster.replace(world_size=world), workload=settings.workload.replace(steps=steps)))
    cost = CostModel(s.model, s.hardware).for_cluster(s.cluster)
    out = []
    for lengths in generate_steps(s.workload):
        try:
            out += [make_plan(samples_from_lengths(lengths), s.cluster, cost, m).group_shapes for m in MODES]
        except PlanError as e:
            raise PlanError(f"the default workload on {world} ranks: {e}") from None
    return out


def measure(settings: Settings) -> list[dict]:
    """On the current process group: both ways, each rank's figures gathered to every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = datetime.timedelta(seconds=settings.bench.timeout)
    shapes = [used_groups(settings, world, settings.workload.steps) if rank == 0 else None]
    dist.broadcast_object_list(shapes, src=0)
    lazy = ExchangeGroups(world, timeout)
    first = None
    for step in shapes[0]:
        lazy.ensure(step)
        first = lazy.seconds if first is None else first
    eager = ExchangeGroups(world, timeout)
    eager.ensure_every_aligned_group()
    mine = [(lazy.seconds, lazy.held, first), (eager.seconds, eager.held, eager.seconds)]
    every = [None] * world
    dist.all_gather_object(every, mine)
    rows = []
    for k, (way, made) in enumerate((("lazy: the groups the plans use", len(lazy.made)), ("eager: every aligned group", len(eager.made)))):
        seconds = [e[k][0] for e in every]
        held = [e[k][1] for e in every]
        rows.append(
            {
                "world": world,
                "gpus_per_node": settings.cluster.gpus_per_node,
                "way": way,
                "new_group_calls": made,
                "held_max": max(held),
                "held_min": min(held),
                "seconds_max": round(max(seconds), 4),
                "first_step_seconds_max": round(max(e[k][2] for e in every), 4),
                "steps": len(shapes[0]) // len(MODES) if k == 0 else 0,
            }
        )
    return rows


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        print(
            f"{r['world']:4d} ranks ({r['gpus_per_node']}/node) {r['way']:>31}: {r['new_group_calls']:4d} new_group calls, a rank holds "
            f"{r['held_min']}-{r['held_max']}, {r['seconds_max']:.3f} s (first step {r['first_step_seconds_max']:.3f} s)",
            flush=True,
        )


def main(argv=None):
    settings = entry.parse(COMMAND, argv, resolve_workload=False)  # resolved for each world it runs
    with entry.user_errors():
        check_output_dir(settings.bench.out)
    ctx = provenance()
    with entry.user_errors():  # a local world that makes no whole nodes, before any rank starts
        rows = measure_ranks(measure, settings, print_rows)
    if rows is not None:
        write_rows(os.path.join(settings.bench.out, "groups_bench.csv"), rows, ctx)


if __name__ == "__main__":
    main()
