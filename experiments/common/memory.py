"""Memory per rank of a training run: an estimate from the model's shapes, printed at start-up
(the table over presets and GPU counts: python -m experiments.bench.memory).

An estimate, not a measurement: parameters, gradients and AdamW state (exact byte counts of this
code's tensors) plus activations saved for the backward (counted from the layers' saved tensors,
no recompute) plus the fp32 logits. Sharded (FSDP2): fp32 master parameters, gradients and Adam
state divided over the ranks, and two blocks' parameters unsharded at a time (the one running
and the one prefetched) plus the root's (embedding, head). Replicated: all of it on every rank.
"""

from __future__ import annotations

import os

from config import HardwareConfig, ModelConfig
from solver import CostModel

GIB = 1 << 30
ADAM_BYTES = 8  # two fp32 moments per parameter


def saved_elements_per_token(cfg: ModelConfig) -> float:
    """Elements one layer keeps for the backward per token: norms and residuals (6 x hidden), the
    QKV projection, its rotary and exchanged copies (3 x QKV), the attention output before and
    after its exit exchange (2 x H x D), router probabilities, and the MoE's per-slot copies
    (input, three ffn-wide products and the output with its weighting: top_k x (3 hidden + 4 ffn)),
    and the shared experts' likewise where the model has them."""
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    shared = 3 * cfg.hidden + 4 * cfg.shared_expert_ffn if cfg.shared_expert_ffn else 0
    return (
        6 * cfg.hidden
        + 3 * qkv
        + 2 * cfg.n_heads * cfg.head_dim
        + cfg.n_experts
        + cfg.top_k * (3 * cfg.hidden + 4 * cfg.expert_ffn)
        + shared
    )


def estimate(
    cfg: ModelConfig,
    world: int,
    tokens_per_rank: int,
    shard: str = "fsdp",
    mixed_precision: bool = True,
    recompute: str = "full",
    ep: int = 1,
) -> dict[str, float]:
    """Bytes per rank by component, and their total. Full recompute keeps each block's input and
    one block's activations at a time (the one being re-run); selective and none keep them all
    (selective drops only attention's internals, which the flash kernels do not keep anyway).
    Under expert parallelism of degree `ep` a rank holds n_experts / ep of each block's experts:
    sharded over their world / ep replicas (the same bytes per rank at rest), gathered 1 / ep of
    them at a time."""
    cost = CostModel(cfg, HardwareConfig())
    params = cost.total_params() + (2 * cfg.n_layers + 1) * cfg.hidden  # + the RMSNorm weights the cost model leaves out
    experts = cost.expert_params() / max(cfg.n_moe, 1)  # one MoE block's
    block = (params - cost.lm_head_params - (0 if cfg.tie_embeddings else cfg.vocab * cfg.hidden)) / cfg.n_layers
    root = params - cfg.n_layers * block
    params -= cost.expert_params() * (1 - 1 / ep) * (shard != "fsdp")  # replicated: a rank holds its experts only
    block -= experts * (1 - 1 / ep)  # what a rank gathers of a block
    act_bytes = 2 if mixed_precision else 4
    out = {}
    if shard == "fsdp":
        out["parameters (fp32 shards)"] = 4 * params / world
        out["gradients (fp32 shards)"] = 4 * params / world
        out["AdamW state"] = ADAM_BYTES * params / world
        out["unsharded parameters (2 blocks + root)"] = act_bytes * (2 * block + root)
    else:
        out["parameters (fp32)"] = 4 * params
        out["gradients (fp32)"] = 4 * params
        out["AdamW state"] = ADAM_BYTES * params
    per_token = saved_elements_per_token(cfg)
    layers = cfg.n_layers * cfg.hidden + per_token if recompute == "full" else cfg.n_layers * per_token
    out["activations"] = act_bytes * tokens_per_rank * layers
    out["logits (fp32, with their gradient)"] = 2 * 4 * tokens_per_rank * cfg.vocab
    out["total"] = sum(out.values())
    return out


def summary(cfg: ModelConfig, world: int, tokens_per_rank: int, shard: str, mixed_precision: bool, recompute: str, ep: int = 1) -> str:
    e = estimate(cfg, world, tokens_per_rank, shard, mixed_precision, recompute, ep)
    unit, div = ("GiB", GIB) if e["total"] >= GIB else ("MiB", 1 << 20)
    parts = ", ".join(f"{k} {v / div:.2f}" for k, v in e.items() if k != "total")
    head = f"memory per rank (estimate, {shard}, EP{ep}, recompute {recompute}, {world} ranks, {tokens_per_rank} tokens per rank)"
    return f"{head}: {e['total'] / div:.2f} {unit} ({parts})"


def available(device) -> float | None:
    """Bytes this rank can use: the GPU's free memory on CUDA; on a CPU the machine's available
    memory shared by this node's ranks (LOCAL_WORLD_SIZE); None where it cannot be read."""
    if device.type == "cuda":
        import torch  # noqa: PLC0415  (the estimate itself needs no torch)

        free, _ = torch.cuda.mem_get_info(device)
        return float(free)
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return 1024.0 * kib / int(os.environ.get("LOCAL_WORLD_SIZE", 1))
