"""Parameter sharding with FSDP2 (`fully_shard`), over the whole world; under expert parallelism
the experts over their replicas.

Ulysses ranks hold different tokens of the same model, so for the parameters they are data-
parallel ranks: every block and the root are sharded over all ranks of the job (one mesh
dimension, as `dp_shard * cp` folds context parallelism into the shard mesh). Gradients keep the
replicated step's meaning: each rank's loss is already its share of the global sum, so the
reduce-scatter must sum, not average; the divide factor is set to 1 on every sharded module (it
is per module: set on the root alone, the blocks would still average). Under expert parallelism
of degree N a rank holds n_experts / N experts (HybridMoE.expert_parallel); each block's experts
are sharded over the world / N ranks that hold the same ones, so their gradients sum over those
replicas only (each replica computes its experts' gradient from the tokens its EP group sent),
as the cost model's gradient sync assumes.

FSDP2 pads the dim it shards a parameter on to a multiple of its shard group, and gathers the
padding too. Each parameter is sharded on the dim that pads least (solver.cost.shard_dim): its
first wherever that divides, else e.g. an expert's hidden dim where a slot's 16 experts are held
by 128 replicas (on 1,024 ranks at EP 8), which on its first dim would be gathered 8 times over.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from solver.cost import shard_dim

SHARDINGS = ("fsdp", "none")  # none: replicated parameters, gradients all-reduced in buckets


def shard_model(model: nn.Module, device: torch.device, mixed_precision: bool | None = None, timeout=None) -> nn.Module:
    """fully_shard each block, then the root, over every rank. mixed_precision (default: on CUDA):
    bf16 parameters in forward and backward, fp32 gradient reduction, fp32 sharded master copy.
    timeout (a timedelta): how long FSDP's collectives may wait (its group does not inherit the
    default group's)."""
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415  (needs a process group)
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    # a process group of its own: FSDP's collectives never share a queue with the step's own
    # collectives on the world group (the aux loss's all-reduce, forward and backward)
    mesh = DeviceMesh.from_group(_shard_group(timeout), device.type, mesh_dim_names=("shard",))
    if mixed_precision is None:
        mixed_precision = device.type == "cuda"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else MixedPrecisionPolicy()
    ep = getattr(model, "ep", 1)
    if ep > 1:  # a rank's experts shard over the ranks that hold the same ones, and their gradients sum there
        replicas = DeviceMesh.from_group(replica_group(ep, timeout), device.type, mesh_dim_names=("replicas",))
    for block in model.blocks:
        if ep > 1 and block.moe is not None:  # a dense first block has no experts
            fully_shard(block.moe.experts, mesh=replicas, mp_policy=mp, shard_placement_fn=_least_padding(replicas.size()))
        fully_shard(block, mesh=mesh, mp_policy=mp, shard_placement_fn=_least_padding(mesh.size()))
    fully_shard(model, mesh=mesh, mp_policy=mp, shard_placement_fn=_least_padding(mesh.size()))
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum over ranks: each rank's loss is its share of the global sum
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM; NCCL's is not zero-copy)
    return model


def _least_padding(ranks: int):
    """fully_shard's shard_placement_fn: each parameter on the dim that pads least over `ranks`."""
    from torch.distributed.tensor import Shard  # noqa: PLC0415

    return lambda p: Shard(shard_dim(tuple(p.shape), ranks))


_GROUPS: dict = {}


def _shard_group(timeout=None):
    """FSDP's process group of every rank, made once per default group (every rank shards the same
    models in the same order, so every rank finds it made, or makes it, at the same call)."""
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(range(dist.get_world_size())), timeout=timeout)
    return _GROUPS[key]


def replica_ranks(ep: int, world: int, rank: int) -> list[int]:
    """The ranks holding the same experts as `rank` under expert parallelism of degree `ep`: one
    in each aligned EP group, at the same slot.

    >>> replica_ranks(4, 16, 6)
    [2, 6, 10, 14]
    """
    return list(range(rank % ep, world, ep))


def replica_group(ep: int, timeout=None):
    """This rank's replica group, made once per (default group, ep): every rank makes all ep of
    them, slot by slot, and keeps its own."""
    key = (id(dist.distributed_c10d._get_default_group()), "replicas", ep)
    if key not in _GROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
        made = [dist.new_group(replica_ranks(ep, world, slot), timeout=timeout) for slot in range(ep)]
        _GROUPS[key] = made[rank % ep]
    return _GROUPS[key]


def replicate_experts(model: nn.Module, timeout=None) -> nn.Module:
    """Replicated parameters (no FSDP2) under expert parallelism: the model keeps the process group
    of its experts' replicas, over which model.distributed.allreduce_grads sums their gradients
    (every other gradient sums over the world). Collective: every rank calls it alike."""
    ep = getattr(model, "ep", 1)
    model.expert_replicas = replica_group(ep, timeout) if ep > 1 else None
    return model


def is_sharded(model: nn.Module) -> bool:
    """The model is sharded by FSDP2. A model fully_shard made is an instance of a class from
    torch.distributed.fsdp, so where that package was never imported no model is: asked so, it is
    not imported (a second of imports, DTensor's and sympy's, for every rank of a replicated run)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter or gradient gathered whole; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ----- the experts' global layout, for checkpoints ----------------------------------------------------
def expert_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """FQN -> parameter of every expert weight (model.experts.Experts), as the model's own
    named_parameters (and so get_state_dict) names them."""
    from model.experts import Experts  # noqa: PLC0415  (model.experts imports kernels; sharding stays light)

    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Experts):
            for p in ("w1", "w3", "w2"):
                out[f"{name}.{p}" if name else p] = getattr(mod, p)
    return out


def _expert_mesh(ep: int, world: int, device_type: str):
    """A 2-D mesh (slot, replica) of the world: mesh[s, j] = j ep + s, so the groups along dim 0
    are the aligned EP groups (rank // ep) and those along dim 1 the replica groups (rank % ep).
    No process group is made: a checkpoint only needs each rank's coordinate."""
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415

    mesh = torch.arange(world).reshape(world // ep, ep).T.contiguous()
    return DeviceMesh(device_type, mesh, mesh_dim_names=("ep_slot", "ep_replica"), _init_backend=False)


def experts_as_global(state: dict, model: nn.Module) -> dict:
    """The model's or the optimizer's state dict (get_state_dict's) with every expert tensor under
    expert parallelism of degree ep > 1 shown as the whole layer's: a DTensor of global shape
    [n_experts, ...] on the (slot, replica) mesh, sharded on dim 0 by slot, then by FSDP2 over the
    replicas on the dim it shards (or replicated across them), sharing storage with the tensor it
    wraps.

    Without it every EP slot saves its n_experts / ep experts under the same name and shape, and a
    checkpoint keeps one slot's. With it DCP writes every expert once (the replicas' copies are
    one chunk) and reads back any slice: a checkpoint written at one EP degree loads at another.
    Loading into the returned dict writes into the model's and the optimizer's own tensors.
    Under ep = 1 the dict is returned as it is (every rank's experts are the layer's)."""
    ep = getattr(model, "ep", 1)
    if ep == 1:
        return state
    from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: PLC0415

    params = expert_params(model)
    mesh = _expert_mesh(ep, dist.get_world_size(), next(iter(params.values())).device.type)  # a DTensor's device is its shard's
    shapes = {n: tuple(p.shape) for n, p in params.items()}  # a slot's experts (FSDP2's DTensor: its global shape)

    def wrap(name: str, t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or tuple(t.shape) != shapes[name]:
            return t  # a step counter, or not an expert tensor
        sharded = isinstance(t, DTensor)
        local = t.to_local() if sharded else t
        size = (shapes[name][0] * ep, *shapes[name][1:])
        placements = (Shard(0), t.placements[0] if sharded else Replicate())  # FSDP2's: Shard(shard_dim)
        stride = torch.empty(size, device="meta").stride()
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(size), stride=stride)

    if "state" in state and "param_groups" in state:  # an optimizer's: {"state": {fqn: {name: tensor}}, ...}
        return {**state, "state": {f: ({k: wrap(f, v) for k, v in s.items()} if f in params else s) for f, s in state["state"].items()}}
    return {k: wrap(k, v) if k in params else v for k, v in state.items()}


def parameter_count(cfg) -> int:
    """The whole model's parameter count (every expert once), from its config alone: the yardstick a
    checkpoint's saved elements are held to, whatever the layout."""
    from model.hybrid import HybridMoE  # noqa: PLC0415

    with torch.device("meta"):
        return sum(p.numel() for p in HybridMoE(cfg).parameters())
