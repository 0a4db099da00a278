"""Calibrate the cost model on the machines at hand: measure, fit, write a hardware profile.

    # this machine: 4 gloo ranks as 2 nodes of 2, the tiny model
    torchrun --standalone --nproc-per-node 4 -m experiments.calibrate --gpus-per-node 2 --out results/calibrate
    # a GPU cluster (on every node), for the model it will train
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        -m experiments.calibrate --model small --out results/calibrate
    # then plan with it
    python -m experiments.ablation --hardware results/calibrate/profile.json

What it measures and fits: experiments.calibrate.measure. It prints every fit with its
residuals and writes <out>/profile.json: the hardware settings, the measurements, the fits, and
device, world, commit and date.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from config import Cluster, ModelConfig
from config.cli import Command, Derived
from config.entries import CalibrateOptions
from experiments.calibrate.measure import calibrate, report
from experiments.common import entry
from experiments.common.files import check_output_dir
from experiments.common.ranks import end_rank, leave, start_rank
from experiments.common.settings import MODEL_CHOICES
from model.attention import BACKENDS

COMMAND = Command(
    "experiments.calibrate",
    __doc__,
    (ModelConfig, Cluster, CalibrateOptions),
    defaults={
        "model": "tiny",
        "cluster.world_size": Derived(lambda s: int(os.environ.get("WORLD_SIZE", 1)), "the launcher's WORLD_SIZE"),
        "cluster.gpus_per_node": Derived(
            lambda s: int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1))), "the launcher's LOCAL_WORLD_SIZE"
        ),
    },
    exclude=frozenset({"cluster.world_size"}),
    choices={"calibrate.attn_backend": BACKENDS, **MODEL_CHOICES},
)


def main(argv=None):
    rank = int(os.environ.get("RANK", 0))
    s = entry.parse(COMMAND, argv)
    with entry.user_errors():
        check_output_dir(s.calibrate.out)
    c = s.calibrate
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    start_rank(rank, s.cluster.world_size, c.timeout)
    try:
        profile = calibrate(
            s.model,
            s.cluster.gpus_per_node,
            s.cluster.tokens_per_rank,
            c.quick,
            c.datasheet_peak,
            c.attn_backend,
            c.median_of,
            c.step_tokens,
            c.step_rounds,
        )
    except Exception as e:  # noqa: BLE001 - every failure ends the job with its rank and reason
        print(f"[rank {rank}] failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        leave(1)
    if rank == 0:
        path = os.path.join(c.out, "profile.json")
        with open(path, "w") as f:
            json.dump(profile, f, indent=1)
        print(report(profile))
        print(f"wrote {path}")
    end_rank()


if __name__ == "__main__":
    main()
    leave()
