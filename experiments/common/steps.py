"""The runtime's whole step as the calibration and the benchmarks time it: its plans (ranks in
aligned groups, a few short samples each) and the slowest rank's seconds, every rank starting at
once."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from config import Cluster, ModelConfig, SettingError
from config.entries import STEP_SAMPLE_TOKENS
from kernels.exchange import ExchangeGroups
from model import HybridMoE


def step_device() -> tuple[torch.device, torch.dtype]:
    """The device the runtime steps are timed on and their dtype: this rank's GPU in bf16 where
    CUDA is present, else the CPU in fp32."""
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_once(fn, device) -> float:
    """The slowest rank's seconds for one fn() that every rank starts at once."""
    dist.barrier()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)  # NCCL reduces device tensors
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def timed(fn, device, repeats: int) -> float:
    """The median over repeats of the slowest rank's seconds for fn() (every rank runs it at once)."""
    fn()  # warm-up
    return float(np.median([time_once(fn, device) for _ in range(repeats)]))


def runtime_step_plan(
    world: int, node: int, size: int = 1, tokens: int = STEP_SAMPLE_TOKENS, halo: bool = False, samples: int | tuple[int, ...] = 1
):
    """The plan of a runtime step the calibration (measure_runtime_steps) or a benchmark times:
    aligned groups of `size` ranks, each holding `samples` samples of `tokens` tokens per rank (or,
    given one count per group, that group's count). Size 1 exchanges nothing; groups of a node's
    ranks exchange inside nodes only; wider groups across nodes. `halo`: each group's sparse layers
    run on its own token layout by halo exchange (a parent+halo plan): the full layers'
    all-to-alls, the sparse layers' point-to-point calls."""
    from solver import Group, StepPlan, Way  # noqa: PLC0415
    from solver.plan import NODE_LOCAL, ParentPlan  # noqa: PLC0415

    if size < 1 or world % size:
        raise ValueError(f"runtime step groups of {size} ranks do not tile {world} ranks: use a power of two dividing it")
    if halo and size == 1:
        raise ValueError("a runtime halo step needs groups of 2 ranks or more: a rank alone exchanges nothing")
    counts = (samples,) * (world // size) if isinstance(samples, int) else tuple(samples)
    if len(counts) != world // size:
        raise ValueError(f"{len(counts)} sample counts for {world // size} groups of {size} ranks: give one per group, or one for all")
    if min(counts) < 1:
        raise ValueError(f"a runtime step group holds {min(counts)} samples: it needs 1 or more")
    reason = NODE_LOCAL if size <= node else "one group across nodes: what its exchanges cost in a step"
    first = np.concatenate([[0], np.cumsum(counts)])
    groups = [Group(k * size, size, tuple(range(first[k], first[k + 1]))) for k in range(world // size)]
    if tokens < 2:
        raise SettingError(f"--step-tokens={tokens} is invalid: it must be 2 or more (a sample needs a label)")
    lengths = tuple((i, tokens * size) for i in range(int(first[-1])))
    parents = tuple(ParentPlan(g, (Group(g.start, g.size, g.samples, Way.HALO if halo else Way.ULYSSES),), reason) for g in groups)
    label = "runtime step: each group its own layout" + (", sparse layers by halo exchange" if halo else "")
    return StepPlan(Cluster(world, node, tokens * max(counts)), lengths, parents, label).validate()


def time_runtime_steps(
    cfg: ModelConfig, plans: dict, groups: ExchangeGroups, device, dtype, rounds: int, replicated: frozenset = frozenset()
) -> dict[str, list[float]]:
    """Seconds of the driver's whole step on each named plan, one model for all (sharded by FSDP2
    over every rank where there is more than one), each step warmed up once; a name in
    `replicated` runs on a replicated copy of the model instead, its gradients' all-reduce left
    out of its time (the same step without FSDP2's gathers and reductions). In `rounds` rounds,
    each timing every plan once, in turn (the slowest rank's seconds): a slow spell of the machine
    lands on the plans of one round alike rather than on one plan's repeats, and fits pair each
    round's steps. Returns each plan's seconds, round by round."""
    from model.distributed import run_step  # noqa: PLC0415
    from model.sharding import shard_model  # noqa: PLC0415

    torch.manual_seed(0)
    model = HybridMoE(cfg, "full").to(device=device, dtype=dtype)
    if dist.get_world_size() > 1:
        shard_model(model, device)
    steps = {}
    for name, plan in plans.items():
        gen = np.random.default_rng(0)
        batch = {k: gen.integers(0, cfg.vocab, n) for k, n in plan.lengths}
        if name in replicated:
            torch.manual_seed(0)
            copy = HybridMoE(cfg, "full").to(device=device, dtype=dtype)

            def step(plan=plan, batch=batch, copy=copy):
                phases = {}
                run_step(copy, plan, batch, groups, timers=phases)
                copy.zero_grad(set_to_none=True)
                return sum(t for phase, t in phases.items() if phase != "grad_sync")  # the step's phases but the all-reduce

        else:

            def step(plan=plan, batch=batch):
                run_step(model, plan, batch, groups)
                model.zero_grad(set_to_none=True)

        step()  # warm-up
        steps[name] = step
    out = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            out[name].append(time_phases(step, device) if name in replicated else time_once(step, device))
    return out


def time_phases(fn, device) -> float:
    """The slowest rank's seconds that fn() returns (its own timing of the phases it counts), every
    rank starting at once."""
    dist.barrier()
    sync(device)
    t = torch.tensor([fn()], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


__all__ = ["runtime_step_plan", "step_device", "sync", "time_once", "time_phases", "time_runtime_steps", "timed"]
