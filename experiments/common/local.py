"""Local gloo ranks forked from this process, for the entry points that measure on a process group
without a launcher (under torchrun they measure on its ranks instead)."""

from __future__ import annotations

import csv
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.common.errors import InputError


def free_port() -> int:
    """A TCP port on the loopback nothing listens on now (for one local process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, timeout: datetime.timedelta, measure, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout)
    try:
        out = measure(*args)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def run_local(measure, world: int, timeout: datetime.timedelta, *args):
    """measure(*args) on `world` gloo ranks forked from this process (they start with its imports,
    one thread each); what rank 0's call returned. A collective that waits past `timeout` fails
    the run naming the rank."""
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(world, free_port(), timeout, measure, args, queue), nprocs=world, join=True, start_method="fork")
    return queue.get()


def measure_ranks(measure, settings, print_rows, local_settings=None) -> list[dict] | None:
    """A benchmark's rows from measure(settings) on a process group: under a launcher its ranks (NCCL
    on CUDA, else gloo; cluster.gpus_per_node its LOCAL_WORLD_SIZE), the rows on rank 0 and None on
    the others; without one, each of settings.bench.worlds as local gloo ranks (the settings of
    each from local_settings(settings, world) where given), the rows of every world; InputError
    before any starts where a world makes no whole nodes of its cluster.gpus_per_node. Each
    process group's rows are printed by print_rows as it finishes; a collective that waits past
    settings.bench.timeout fails the run."""
    timeout = datetime.timedelta(seconds=settings.bench.timeout)
    if "WORLD_SIZE" not in os.environ:
        sizes = [int(x) for x in settings.bench.worlds.split(",")]
        worlds = [(w, local_settings(settings, w) if local_settings else settings) for w in sizes]
        for world, s in worlds:  # every world checked before the first starts
            node = s.cluster.gpus_per_node
            if world % node:
                raise InputError(
                    f"--worlds {settings.bench.worlds}: {world} ranks do not make nodes of --gpus-per-node {node}; "
                    f"give worlds that are multiples of {node}, or a --gpus-per-node that divides each"
                )
        rows = []
        for world, s in worlds:
            mine = run_local(measure, world, timeout, s)
            print_rows(mine)
            rows += mine
        return rows
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", settings.cluster.gpus_per_node))
    rows = measure(settings.replace(cluster=settings.cluster.replace(gpus_per_node=local)))
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank:
        return None
    print_rows(rows)
    return rows


def write_rows(path: str, rows: list[dict], ctx: dict) -> None:
    """A CSV of `rows`, each with the run's provenance `ctx` in columns after its own."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0], *ctx])
        w.writeheader()
        w.writerows({**r, **ctx} for r in rows)
    print(f"wrote {path}")


__all__ = ["free_port", "measure_ranks", "run_local", "write_rows"]
