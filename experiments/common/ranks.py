"""How a rank of a job (torchrun, one process per rank; or a plain `python -m`, one rank) joins
its process group, and how it ends: once its work is done, and once it has failed.

A finished rank meets the others, destroys its process groups while the interpreter is whole,
then leaves at once with `os._exit`, skipping the interpreter's teardown. That teardown is where
a gloo rank aborted (SIGABRT, "terminate called without an active exception") after a run whose
results were all written: a communication thread still holding a tensor with a Python object
asks for the GIL while the interpreter finalizes, the thread is unwound, and the C++ runtime
terminates the process. Forked ranks (`torch.multiprocessing`) already leave this way: a forked
child ends in `os._exit`. `faulthandler` prints every thread's Python stack if a rank aborts
anyway, so the job's log says where it was.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist


def start_rank(rank: int, world: int, timeout: float) -> None:
    """Join the job's process group (NCCL on CUDA, gloo elsewhere), every collective bounded by
    `timeout` seconds. Under a launcher (MASTER_ADDR set) at its rendezvous; a plain run of one
    rank in a store of its own, so it takes no port and any number run side by side. A rank
    killed by a fatal signal (SIGABRT, SIGSEGV) prints where every thread was."""
    faulthandler.enable(all_threads=True)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    bound = datetime.timedelta(seconds=timeout)
    if "MASTER_ADDR" not in os.environ and world == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=bound)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=bound)


def end_rank() -> None:
    """A rank whose work is done: every rank arrives here (a barrier on the default group, bounded
    by its timeout), the work objects no longer referenced are freed, then the process groups are
    destroyed. Call `leave` after it, outside any in-process caller."""
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def leave(code: int = 0) -> NoReturn:
    """End the process now with `code`, its output flushed, without the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
