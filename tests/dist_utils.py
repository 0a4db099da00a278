"""Spawn a gloo process group on CPU and run a test body on every rank."""

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args):
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)  # several ranks share few cores: one thread each, as torchrun sets
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
    )
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args):
    """Run fn(rank, world_size, *args) on `world_size` spawned ranks; re-raises a rank's failure."""
    mp.spawn(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)
