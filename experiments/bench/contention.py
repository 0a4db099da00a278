"""What a sample adds to a step as the ranks that loop over samples share the machine's cores.

    python -m experiments.bench.contention                  # 2, 4 and 8 local gloo ranks
    python -m experiments.bench.contention --worlds 8       # one world
    torchrun ... -m experiments.bench.contention            # the ranks at hand (e.g. the emulated cluster:
        python -m experiments.calibrate.emulate --nodes 4 --gpus-per-node 2 -- -m experiments.bench.contention)

The simulator prices a step on dedicated devices: a sample costs the rank that loops over it the
same whatever the other ranks do. Ranks that share a CPU's cores (the emulated cluster: every
node's ranks on the development machine's cores) do not work that way: a rank's work runs as
fast as the ranks working beside it let it. This times the runtime's step as the calibration
does (experiments.calibrate: ranks alone, FSDP2 over every rank, full recompute, --step-tokens
tokens a sample), first with one sample a rank, then with --samples samples on some ranks and
one on the others: on every rank (what the calibration's per-sample fit times), on the first
rank of each node (where there is more than one node), and on rank 0 alone. Per way: the step's
seconds with one sample a rank (the slowest rank's, the median of --rounds rounds, every step
once a round), what the extra samples added to it (the median over rounds of the loaded step
less that round's step of one sample a rank) and that over the extra samples. On dedicated
devices the three ways cost a sample alike. Writes <out>/contention_bench.csv (a row per world
size and way).
"""

from __future__ import annotations

import datetime
import os

import numpy as np
import torch.distributed as dist

from config import Cluster, ModelConfig
from config.cli import Command, Settings
from config.entries import ContentionBenchOptions
from experiments.common import entry
from experiments.common.files import check_output_dir
from experiments.common.local import measure_ranks, write_rows
from experiments.common.provenance import provenance
from experiments.common.steps import runtime_step_plan, step_device, time_runtime_steps
from kernels.exchange import ExchangeGroups

COMMAND = Command(
    "experiments.bench.contention",
    __doc__,
    (ModelConfig, Cluster, ContentionBenchOptions),
    defaults={"model": "tiny"},
    only={"model": (), "cluster": ()},
)

EVERY, PER_NODE, ONE = "every rank", "the first rank of each node", "rank 0 alone"


def ways(world: int, node: int) -> dict[str, tuple[int, ...]]:
    """The ranks that loop over the extra samples in each way; the first rank of each node only
    where that is neither every rank (nodes of one rank) nor rank 0 alone (one node), and rank 0
    alone only where it is not every rank."""
    out = {EVERY: tuple(range(world))}
    if 1 < node < world:
        out[PER_NODE] = tuple(range(0, world, node))
    if world > 1:
        out[ONE] = (0,)
    return out


def measure(settings: Settings) -> list[dict]:
    """On the current process group: every way's step against one sample a rank, rows as the
    module's docstring says (every rank returns them)."""
    world, node, b = dist.get_world_size(), settings.cluster.gpus_per_node, settings.bench
    if world % node:
        raise ValueError(f"{world} ranks do not tile nodes of {node}: give --gpus-per-node dividing the world")
    device, dtype = step_device()
    loaded = ways(world, node)
    plans = {"one sample a rank": runtime_step_plan(world, node, 1, b.step_tokens)}
    for way, ranks in loaded.items():
        counts = tuple(b.samples if r in ranks else 1 for r in range(world))
        plans[way] = runtime_step_plan(world, node, 1, b.step_tokens, samples=counts)
    groups = ExchangeGroups(world, datetime.timedelta(seconds=b.timeout))
    seconds = time_runtime_steps(settings.model, plans, groups, device, dtype, b.rounds)
    base = np.array(seconds.pop("one sample a rank"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    every = None
    rows = []
    for way, ranks in loaded.items():
        added = float(np.median(np.array(seconds[way]) - base))  # paired round by round: a slow spell lands on both
        per_sample = added / (b.samples - 1)
        every = per_sample if way == EVERY else every
        rows.append(
            {
                "world": world,
                "gpus_per_node": node,
                "cores": cores,
                "device": device.type,
                "way": way,
                "loaded_ranks": len(ranks),
                "samples": b.samples,
                "step_tokens": b.step_tokens,
                "rounds": b.rounds,
                "base_ms": round(1e3 * float(np.median(base)), 2),
                "added_ms": round(1e3 * added, 2),
                "per_sample_ms": round(1e3 * per_sample, 3),
                "vs_every_rank": round(per_sample / every, 3) if every else "",
            }
        )
    return rows


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        vs = f" ({r['vs_every_rank']:.2f}x every rank's)" if r["vs_every_rank"] != "" else ""
        print(
            f"{r['world']:4d} ranks ({r['gpus_per_node']}/node, {r['cores']} cores) {r['way']:>27} "
            f"({r['loaded_ranks']} of {r['world']} with {r['samples']} samples): {r['added_ms']:.1f} ms more than "
            f"{r['base_ms']:.1f}, {r['per_sample_ms']:.2f} ms per extra sample{vs}",
            flush=True,
        )


def main(argv=None):
    settings = entry.parse(COMMAND, argv)
    with entry.user_errors():
        check_output_dir(settings.bench.out)
    ctx = provenance()
    # local ranks on this machine are one node
    rows = measure_ranks(measure, settings, print_rows, lambda s, world: s.replace(cluster=s.cluster.replace(gpus_per_node=world)))
    if rows is not None:
        write_rows(os.path.join(settings.bench.out, "contention_bench.csv"), rows, ctx)


if __name__ == "__main__":
    main()
