"""Training driver: one process per GPU under torchrun (NCCL), or per CPU rank (gloo).

    # this machine: 8 CPU ranks emulating 4 nodes of 2, tiny model
    torchrun --standalone --nproc-per-node 8 -m experiments.train --model tiny --gpus-per-node 2 --steps 20
    # a 4-node x 8-GPU cluster (run on every node)
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        -m experiments.train --model small --mode repack+solver --steps 200

Every rank computes each step's plan from the same data; the plans' hashes are compared across
ranks before any exchange. One log line per step from rank 0; results per step in the schema of
experiments.common.results (engine "torch"); checkpoints saved atomically every --save-every
steps. A failing rank prints its rank and reason and exits non-zero; torchrun then ends the job,
and collectives time out after --timeout seconds rather than hang. The world size is the
launcher's (WORLD_SIZE), and a node's ranks are LOCAL_WORLD_SIZE unless --gpus-per-node says.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist

from config import TINY_TOKENS_PER_RANK, Cluster, CostsConfig, HardwareConfig, ModelConfig, OptimConfig, PlannerConfig, WorkloadConfig
from config.cli import Command, Derived
from config.entries import TrainOptions
from experiments.common import entry
from experiments.common.ranks import end_rank, leave, start_rank
from experiments.common.settings import MODEL_CHOICES
from experiments.train.driver import DTYPES, check_options, stuck_ranks, train
from kernels.permute import PACK_BACKENDS
from model.attention import BACKENDS
from model.sharding import SHARDINGS
from solver.cluster import InternalError
from solver.modes import MODES, modes_help


def _tiny(s) -> bool:
    return s.model.name.startswith("tiny")


COMMAND = Command(
    "experiments.train",
    __doc__,
    (ModelConfig, HardwareConfig, Cluster, CostsConfig, WorkloadConfig, PlannerConfig, OptimConfig, TrainOptions),
    defaults={
        "model": "tiny",
        "cluster.world_size": Derived(lambda s: int(os.environ.get("WORLD_SIZE", 1)), "the launcher's WORLD_SIZE"),
        "cluster.gpus_per_node": Derived(
            lambda s: int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))), "the launcher's LOCAL_WORLD_SIZE"
        ),
        "cluster.tokens_per_rank": Derived(lambda s: TINY_TOKENS_PER_RANK if _tiny(s) else 32768, "32 for the tiny models, else 32768"),
        "workload": Derived(lambda s: "tiny" if _tiny(s) else "default", "tiny for the tiny models, else default"),
        "workload.steps": 20,
    },
    exclude=frozenset({"cluster.world_size"}),
    epilog=modes_help() + "\n  all       every mode the sparse kind can run, each step in each, without optimizer steps",
    choices={
        "train.mode": (*MODES, "all"),
        "train.dtype": DTYPES,
        "train.pack_backend": PACK_BACKENDS,
        "train.attn_backend": BACKENDS,
        "train.shard": SHARDINGS,
        **MODEL_CHOICES,
    },
)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def main(argv=None):
    rank = int(os.environ.get("RANK", 0))
    settings = entry.parse(COMMAND, argv, resolve_workload=False)  # the driver's set_up prepares (and re-prepares a replay)
    with entry.user_errors():
        check_options(settings)
    world = settings.cluster.world_size
    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    start_rank(rank, world, settings.train.timeout)
    try:
        train(settings, rank, torch.device(f"cuda:{local}" if cuda else "cpu"))
    except Exception as e:  # noqa: BLE001 - every failure ends the job with its rank and reason
        if isinstance(e, InternalError):  # a bug, not the user's input: its traceback is what a fix needs
            traceback.print_exc()
        timed_out = isinstance(e, dist.DistBackendError) or "timed out" in str(e).lower() or "timeout" in str(e).lower()
        note = f" {stuck_ranks(rank, world)}" if timed_out else ""
        print(f"[rank {rank}] failed: {type(e).__name__}: {_first_line(e)}{note}", file=sys.stderr, flush=True)
        leave(1)
    end_rank()


if __name__ == "__main__":
    main()
    leave()
