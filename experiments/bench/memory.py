"""Memory per rank by model preset and GPU count, sharded (FSDP2, without and with expert
parallelism) and replicated: an estimate from the model's shapes (experiments.common.memory), not a
measurement.

    python -m experiments.bench.memory                        # small and paper, 8 .. 128 GPUs
    python -m experiments.bench.memory --models small --tokens-per-rank 32768 --ep 4
"""

from __future__ import annotations

from config import Cluster, CostsConfig, HardwareConfig, ModelConfig
from config.cli import Command
from config.entries import MemoryOptions
from experiments.common import entry
from experiments.common.memory import GIB, estimate
from solver import CostModel

GPU_COUNTS = (8, 16, 32, 64, 128)


COMMAND = Command(
    "experiments.bench.memory",
    __doc__,
    (Cluster, CostsConfig, MemoryOptions),
    defaults={"cluster.tokens_per_rank": 16384},
    only={"cluster": ("tokens_per_rank", "gpus_per_node"), "costs": ("recompute", "ep_degree")},
)


def main(argv=None):
    s = entry.parse(COMMAND, argv)
    tokens, recompute, gib = s.cluster.tokens_per_rank, s.costs.recompute, s.memory.gpu_gib
    print(f"GiB per rank at {tokens} tokens per rank (bf16 compute, recompute {recompute}); fits: under {gib:g} GiB")
    print(f"{'model':>8} {'params':>8} {'ranks':>6} {'fsdp':>8} {'fits':>5} {'fsdp + EP':>12} {'fits':>5} {'replicated':>11} {'fits':>5}")
    for name in s.memory.models.split(","):
        cfg = ModelConfig.from_name(name)
        cost = CostModel(cfg, HardwareConfig(), costs=s.costs)
        params = cost.total_params()
        for world in GPU_COUNTS:
            ep = cost.for_cluster(s.cluster.replace(world_size=world)).ep_degree  # the --ep given, else a node's
            f = estimate(cfg, world, tokens, "fsdp", recompute=recompute)["total"] / GIB
            e = estimate(cfg, world, tokens, "fsdp", recompute=recompute, ep=ep)["total"] / GIB
            r = estimate(cfg, world, tokens, "none", recompute=recompute)["total"] / GIB
            yes = lambda g: "yes" if g < gib else "no"  # noqa: E731
            print(
                f"{name:>8} {params / 1e9:7.2f}B {world:6d} {f:8.1f} {yes(f):>5} {f'EP{ep} {e:.1f}':>12} {yes(e):>5} {r:11.1f} {yes(r):>5}"
            )


if __name__ == "__main__":
    main()
