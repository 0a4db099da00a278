"""Per-step host work of the distributed step: what one rank builds before its first exchange.

    python -m experiments.bench.host                 # 64 .. 4096 ranks
    python -m experiments.bench.host --quick         # 64 and 256 ranks
    python -m experiments.bench.host --modes halo    # one mode's plans

A benchmark, not a test: for each cluster size and mode it plans one default step and times,
for a spread of ranks, the host work of model.distributed.run_step before the forward: the
RankPlacement (the rank's four exchanges - full-layer entry and exit, sparse-layer entry and
exit - with their device index tensors, both layer types' attention cu_seqlens, the rotary tables; a
halo child's transfers, key rows and key segments; a redistribute plan's all-to-all of the hidden
states) and the rank's tokens and labels (local_batch). Targets, every mode: < 10 ms at 1024
ranks and < 40 ms at 4096 (the worst rank). Writes results/host_bench.csv.
"""

from __future__ import annotations

import csv
import os
import time

import numpy as np
import torch

from config import Cluster, HardwareConfig, ModelConfig, WorkloadConfig
from config.cli import Command
from config.entries import HostBenchOptions
from experiments.common import entry
from experiments.common.files import check_output_dir
from experiments.common.provenance import provenance
from experiments.common.workload import generate_steps, random_tokens
from model.distributed import RankPlacement
from solver import CostModel, make_plan, samples_from_lengths
from solver.modes import MODES

TARGETS_MS = {1024: 10.0, 4096: 40.0}


def rank_host_work(plan, cfg: ModelConfig, rank: int, tokens: dict[int, np.ndarray]) -> bool:
    """What run_step builds for `rank` from a plan before the forward (on the CPU device); whether
    the rank is in a halo child (it built a halo exchange)."""
    ctx = RankPlacement(plan, cfg, rank, groups=None)  # no exchange runs here: no process groups needed
    ctx.local_batch(tokens)
    ctx.rotary.tables(torch.float32)  # made on first use, in the first layer
    return ctx.halo


def time_ranks(plan, cfg: ModelConfig, ranks, repeats: int = 3) -> tuple[dict[int, float], int]:
    """Best of `repeats` per rank, each on a fresh copy of the layouts (no cached rank maps); and
    how many of the ranks are in halo children."""
    tokens = random_tokens([n for _, n in plan.lengths], cfg.vocab, 0, 0)
    out, halo = {}, 0
    for r in ranks:
        best = float("inf")
        for _ in range(repeats):
            fresh = type(plan).from_json(plan.to_json())
            t0 = time.perf_counter()
            in_halo = rank_host_work(fresh, cfg, r, tokens)
            best = min(best, time.perf_counter() - t0)
        out[r] = best
        halo += in_halo
    return out, halo


COMMAND = Command(
    "experiments.bench.host",
    __doc__,
    (ModelConfig, HardwareConfig, HostBenchOptions),
    only={"model": (), "hardware": ()},
    choices={"bench.modes": MODES},
)


def main(argv=None):
    s = entry.parse(COMMAND, argv)
    with entry.user_errors():
        check_output_dir(s.bench.out)
    cfg = s.model
    cost = CostModel(cfg, s.hardware)
    ctx = provenance()
    print(f"host work per rank per step ({ctx['device']}, commit {ctx['commit']}); targets: {TARGETS_MS} ms")
    rows = []
    for world in [64, 256] if s.bench.quick else [64, 256, 1024, 4096]:
        cluster = Cluster(world, 8, Cluster().tokens_per_rank)
        wl = WorkloadConfig(steps=1, seed=world).for_cluster(cluster)  # a default packed step
        samples = samples_from_lengths(generate_steps(wl)[0])
        for mode in s.bench.modes.split(","):
            plan = make_plan(samples, cluster, cost, mode)
            widest = max(plan.parents, key=lambda p: p.group.size).group
            ranks = sorted({0, world // 2, world - 1, widest.start, widest.stop - 1})  # the widest parent's ranks are the costliest
            t, halo = time_ranks(plan, cfg, ranks)
            worst, median = max(t.values()), float(np.median(list(t.values())))
            target = TARGETS_MS.get(world)
            verdict = "" if target is None else f" (target < {target:g} ms: {'met' if 1e3 * worst < target else 'MISSED'})"
            print(
                f"{world:6d} ranks {mode:>14}, widest parent SP{widest.size}: median {1e3 * median:7.2f} ms, "
                f"worst {1e3 * worst:7.2f} ms over ranks {ranks} ({halo} in halo children){verdict}",
                flush=True,
            )
            rows.append(
                {"ranks": world, "mode": mode, "widest_parent": widest.size, "timed_ranks": len(ranks), "halo_ranks": halo}
                | {"median_ms": 1e3 * median, "worst_ms": 1e3 * worst, **ctx}
            )
    path = os.path.join(s.bench.out, "host_bench.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
