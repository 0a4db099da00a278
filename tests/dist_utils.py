"""Spawn a gloo process group on CPU and run a test body on every rank; launch the driver under torchrun."""

import datetime
import os
import socket
import subprocess
import sys

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
    """Run fn(rank, world_size, *args) on `world_size` forked ranks; re-raises a rank's failure.
    Forked, not spawned: a rank starts with this process's imports (torch, the project) instead of
    importing them again, seconds per rank on a small machine; nothing here has touched a GPU.
    FSDP2, the dynamo modules its first fully_shard imports, and DCP are imported here first for
    the same reason: a rank that shards its model or writes a checkpoint would otherwise import
    them itself (DTensor, dynamo and sympy: about two seconds a rank)."""
    import torch._dynamo  # noqa: F401, PLC0415
    import torch.distributed.checkpoint  # noqa: F401, PLC0415
    import torch.distributed.fsdp  # noqa: F401, PLC0415

    mp.start_processes(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True, start_method="fork")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun_cmd(nproc: int, *args, launcher: tuple[str, ...] = ()) -> list[str]:
    """The driver with the tiny model on `nproc` CPU ranks in emulated nodes of 2, collectives
    bounded by 60 s (args override); `launcher`: more of torchrun's own flags."""
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *launcher]
    return [*head, "-m", "experiments.train", "--model", "tiny", "--gpus-per-node", "2", "--timeout", "60", *args]


def torchrun(nproc: int, *args, timeout=240):
    return subprocess.run(torchrun_cmd(nproc, *args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def single_rank_cmd(*args) -> list[str]:
    """The driver as one process (no launcher: world 1), the tiny model, collectives bounded by 60 s."""
    return [sys.executable, "-m", "experiments.train", "--model", "tiny", "--timeout", "60", *args]


def single_rank(*args, timeout=120):
    """single_rank_cmd run to its end, for checks that fail before step 1 or need no second rank:
    seconds, where torchrun's start takes several."""
    return subprocess.run(single_rank_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
