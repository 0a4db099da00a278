"""The training driver's work on one rank: set-up (model, data, optimizer, process groups, a
resumed checkpoint), each step's plans made one step ahead, the measured steps, checkpoints,
results. Its entry point is experiments/train/__main__.py (python -m experiments.train)."""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm import tqdm

from config import Cluster, CostsConfig, HardwareConfig, ModelConfig, SettingError, WorkloadConfig, read_hf_config
from config.cli import Settings
from config.reads import data_source, shown
from experiments.common import memory
from experiments.common.errors import InputError
from experiments.common.files import check_output_dir, file_identity, lock_folder
from experiments.common.provenance import provenance
from experiments.common.results import PAPER, ROW_BYTES, summarize, write_run
from experiments.common.settings import cost_model, prepare
from experiments.common.workload import generate_steps, load_trace, longest_step
from kernels.exchange import CommStats, ExchangeGroups
from model import HybridMoE
from model.distributed import run_step
from model.hf import load_hf, save_hf
from model.hybrid import check_runnable
from model.sharding import parameter_count, replicate_experts, shard_model
from solver import CostModel, PlanError, check_setup, make_plan, samples_from_lengths
from solver.modes import MODES, modes_for
from solver.sites import EVERY_SITE, Family, Site, sites_of

from . import checkpoint
from .data import GeneratedSource, LengthSource, TokenFileSource


class NonFiniteLoss(RuntimeError):
    """A step's loss is nan or inf: the run failed there."""


DTYPES = ("auto", "bf16", "fp32", "fp64")


def compute_dtype(dtype: str, device: torch.device) -> str:
    """--dtype resolved: auto is bf16 on CUDA (what a GPU run trains in), fp32 elsewhere."""
    return ("bf16" if device.type == "cuda" else "fp32") if dtype == "auto" else dtype


TIMED_OUT = "repack/timed_out"  # store key prefix: the ranks that saw a collective time out


def stuck_ranks(rank: int, world: int, wait: float = 5.0) -> str:
    """After a collective timed out on this rank: which ranks did not (they are stopped, or gone,
    or somewhere else entirely). Every rank that times out says so in the job's store, and reads,
    for up to `wait` seconds, which ranks have not (the live ones time out within moments of each
    other: they wait on the same collectives)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=wait))
        store.set(f"{TIMED_OUT}/{rank}", "1")
        deadline = time.monotonic() + wait
        silent = list(range(world))
        while silent and time.monotonic() < deadline:
            silent = [r for r in silent if not store.check([f"{TIMED_OUT}/{r}"])]
            time.sleep(0.2)
    except Exception as e:  # noqa: BLE001 - the store's own host may be the stuck one
        return f"(the job's store did not answer in {wait:g} s: {type(e).__name__}; its host may be the stuck rank)"
    if not silent:
        return "(every rank timed out: a collective of the whole job did not complete)"
    return f"(rank(s) {silent} did not time out with the others: stopped, stuck or gone)"


def check_options(settings: Settings) -> None:
    """The driver's own settings against each other and the folders it writes, before any process
    group or work: a SettingError or InputError naming the flag."""
    t = settings.train
    check_runnable(settings.model)
    if t.repeats > 1 and t.mode != "all":
        raise SettingError(f"--repeats={t.repeats} needs --mode all (no optimizer step between repeats); got --mode {t.mode}")
    if t.tokens and not t.doc_offsets:
        raise SettingError("--tokens needs --doc-offsets (document boundaries)")
    if settings.costs.overlap_blocks != 1:
        raise SettingError(
            f"costs.overlap_blocks (--overlap-blocks)={settings.costs.overlap_blocks} is a priced what-if of the simulator: the "
            f"runtime runs each exchange whole, not pipelined in head blocks (use 1, or run the ablation)"
        )
    steps = min(settings.workload.steps, t.stop_after or settings.workload.steps)  # the rows the run writes, at most
    check_output_dir(t.out, "--out", need=steps * (len(MODES) if t.mode == "all" else 1) * ROW_BYTES)
    if t.save_every or t.resume or t.resume_step is not None:
        # a checkpoint: the weights and AdamW's two moments in fp32 (fp64 runs: twice that); the
        # previous one stays until the new one is complete
        per_param = 3 * (8 if t.dtype == "fp64" else 4)
        check_output_dir(t.ckpt_dir, "--ckpt-dir", need=2 * per_param * parameter_count(settings.model) if t.save_every else 0)


def build_source(settings: Settings):
    """The run's data: a token file, or the workload (a trace or the generator) with random tokens."""
    t, wl = settings.train, settings.workload
    if t.tokens:
        return TokenFileSource(t.tokens, t.doc_offsets, wl.tokens_per_step, settings.model.vocab)
    if wl.trace:
        steps = load_trace(wl.trace)
        return LengthSource([lengths for _, lengths in steps], settings.model.vocab, wl.seed, [n for n, _ in steps])
    return GeneratedSource(wl, settings.model.vocab)


def check_generated(settings: Settings, cost: CostModel) -> None:
    """What every step of the generated workload will hold, checked from its settings before step
    1 (the steps themselves are made as the run reaches them): its longest document fits the
    widest group the heads allow, and its batch fits the cluster."""
    wl, cluster = settings.workload, settings.cluster
    longest, batch = longest_step(wl)
    widest = cost.widest_group(cluster) * cluster.tokens_per_rank
    if longest > widest:
        source = shown(settings, "workload.lengths") if wl.lengths is not None else "--long-max, --body-max"
        raise SettingError(
            f"the workload's documents reach {longest} tokens ({source}), more than the widest group holds "
            f"(SP{cost.widest_group(cluster)} x --tokens-per-rank={cluster.tokens_per_rank} = {widest}): use --tokens-per-rank >= "
            f"{-(-longest // cost.widest_group(cluster))}, shorter documents, or --clip-to-cluster"
        )
    capacity = cluster.world_size * cluster.tokens_per_rank
    if batch > capacity:
        raise SettingError(
            f"a step of the workload packs up to {batch} tokens (--tokens-per-step) but the cluster holds {capacity} "
            f"({cluster.world_size} ranks x --tokens-per-rank={cluster.tokens_per_rank}): give a smaller batch, or a --fill"
        )


def check_expert_parallel(settings: Settings, cost: CostModel) -> None:
    """The expert-parallel degree (the cost model's, --ep) against the world."""
    ep, world = cost.ep_degree, settings.cluster.world_size
    if ep == 1:
        return
    if world % ep:
        raise SettingError(
            f"costs.ep_degree (--ep)={ep} does not divide the world of {world} ranks: expert-parallel groups are aligned groups of "
            f"{ep} ranks that tile it (use --ep 1, or a world that is a multiple of {ep})"
        )


def lock_outputs(settings: Settings, rank: int) -> None:
    """Rank 0 locks the folders the run writes (--out, and --ckpt-dir when it checkpoints or
    resumes) for the run's lifetime; every rank fails alike, naming the folder, when another run
    holds one (experiments.common.files.lock_folder)."""
    t = settings.train
    err = None
    if rank == 0:
        try:
            lock_folder(t.out, "--out")
            if t.save_every or t.resume or t.resume_step is not None:
                lock_folder(t.ckpt_dir, "--ckpt-dir")
        except InputError as e:
            err = str(e)
    errs = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    if errs[0]:
        raise InputError(errs[0])


def check_memory(settings: Settings, device: torch.device) -> str:
    """The memory estimate per rank against what this rank has, before anything is built: a model
    that cannot fit fails here, naming the estimate, instead of in the allocator minutes later.
    Returns the estimate's line (printed by rank 0)."""
    t, cluster = settings.train, settings.cluster
    bf16 = compute_dtype(t.dtype, device) == "bf16"
    args = (settings.model, cluster.world_size, cluster.tokens_per_rank, t.shard, bf16, settings.costs.recompute, settings.costs.ep_degree)
    need = memory.estimate(*args)["total"]
    have = memory.available(device)
    if have is not None and need > have:
        raise SettingError(
            f"model {settings.model.name} needs about {need / memory.GIB:.1f} GiB per rank ({t.shard}, {cluster.world_size} ranks, "
            f"{cluster.tokens_per_rank} tokens per rank; an estimate, python -m experiments.bench.memory) but this rank has "
            f"{have / memory.GIB:.1f} GiB: use more ranks, a smaller --tokens-per-rank or --model, or --shard fsdp"
        )
    return memory.summary(*args)


def replay_steps(folder: str, seed: int | None = None) -> tuple[list[list[int]], list[int], list[int], dict]:
    """An ablation run's data (its first seed's, or `seed`'s): every step's lengths and number,
    the positions of the selected steps, and the ablation's config."""
    path = os.path.join(folder, "summary.json")
    try:
        with open(path) as f:
            summary = json.load(f)
        cfg, selected = summary["config"], summary["selected_steps"]
        workload, seeds = cfg["workload"], cfg["seeds"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"--replay {folder!r}: {path!r} is not an ablation's summary ({type(e).__name__}: {e})") from None
    seed = seeds[0] if seed is None else seed
    if str(seed) not in selected:
        raise InputError(f"--replay {folder!r} has no seed {seed}; its seeds: {sorted(selected)}")
    wl = WorkloadConfig.from_dict({**workload, "seed": seed}, f"--replay {folder!r}: ")
    steps = load_trace(wl.trace) if wl.trace else list(enumerate(generate_steps(wl)))
    position = {n: i for i, (n, _) in enumerate(steps)}
    return [lengths for _, lengths in steps], [n for n, _ in steps], [position[n] for n in selected[str(seed)]], cfg


@dataclass
class Run:
    """Everything one rank sets up before step 1."""

    settings: Settings
    rank: int
    world: int
    device: torch.device
    cost: CostModel
    source: object  # LengthSource or TokenFileSource
    step_ids: Sequence[int]  # the data steps this run trains on, in order
    modes: list[str]
    model: HybridMoE
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    groups: ExchangeGroups
    fingerprint: dict
    start: int = 0  # index into step_ids of the first step to run (after a resume)
    rows: list[dict] = field(default_factory=list)

    @property
    def options(self):
        return self.settings.train

    @property
    def cfg(self) -> ModelConfig:
        return self.settings.model

    @property
    def cluster(self) -> Cluster:
        return self.settings.cluster

    @property
    def hw(self) -> HardwareConfig:
        return self.settings.hardware

    @property
    def stop(self) -> int:
        stop_after = self.options.stop_after
        return len(self.step_ids) if stop_after is None else min(len(self.step_ids), stop_after)


def replayed(settings: Settings) -> tuple[Settings, LengthSource, list[int]]:
    """A replay's settings, data and steps: the ablation's workload (its first seed), its baseline
    pricing, and its costs when the model is the same (so the plans are the ablation's)."""
    folder = settings.train.replay
    where = f"--replay {folder!r}"
    all_steps, numbers, step_ids, abl = replay_steps(folder)
    s = settings.replace(planner=settings.planner.replace(assignment_pricing=abl["planner"]["assignment_pricing"]))
    s.routes["planner.assignment_pricing"] = f"{where}: the ablation's planner.assignment_pricing"
    if abl["model"]["name"] == s.model.name:
        given = sorted(k for k in s.given if k.startswith("costs."))
        if given:  # the ablation's costs replace them: config.reads' rule, known only once the summary is read
            raise SettingError(f"{s.route(given[0])} is not read: {where} runs the ablation's model, priced with its costs")
        s = s.replace(costs=CostsConfig.from_dict(abl["costs"], f"{where}: "))
        s.routes.update({f"costs.{k}": f"{where}: the ablation's costs.{k}" for k in abl["costs"]})
        try:
            cost_model(s)  # the ablation's costs against this run's cluster (its EP degree against the nodes)
        except SettingError as e:
            raise SettingError(s.reroute(str(e))) from None
    return s, LengthSource(all_steps, s.model.vocab, s.workload.seed, numbers), step_ids


def run_data(settings: Settings) -> tuple[Settings, object, Sequence[int]]:
    """The run's settings (a replay's), its data source and the data steps it trains on, in order
    (prepared settings): what the run reads of every data-source setting it was given."""
    if settings.train.replay:
        return replayed(settings)
    source = build_source(settings)
    return settings, source, range(min(settings.workload.steps, len(source)))  # a range: a run of many steps holds no list of them


def init_folder(spec: str) -> str:
    """The folder of --init-from hf:DIR; SettingError naming what would be valid."""
    if not spec.startswith("hf:") or not os.path.isdir(spec[3:]):
        raise SettingError(f"--init-from {spec!r}: give hf:DIR, DIR a folder holding a Hugging Face checkpoint (config.json, safetensors)")
    return spec[3:]


def set_up(settings: Settings, rank: int, device: torch.device) -> Run:
    """Model, cluster, data, optimizer and process groups; restored from a checkpoint on --resume."""
    settings, source, step_ids = run_data(prepare(settings))
    t, world = settings.train, settings.cluster.world_size
    cluster, cost = settings.cluster, cost_model(settings)
    estimate = check_memory(settings, device)  # first: a model that cannot fit is the first thing to say
    # the model against the cluster, and every step against both, before step 1: a file's steps one
    # by one, the generator's from its settings (it makes its steps as the run reaches them)
    loaded = () if isinstance(source, GeneratedSource) else (source.lengths(k) for k in step_ids)
    try:
        allows = check_setup(cluster, cost, loaded)
    except PlanError as e:
        raise PlanError(f"{data_source(settings)}: {e} (flags: --tokens-per-rank, --tokens-per-step, --gpus-per-node, --model)") from None
    if isinstance(source, GeneratedSource):
        check_generated(settings, cost)
    check_expert_parallel(settings, cost)
    fp = fingerprint(settings)
    agree_across_ranks(fp, world)
    expect = {"world_size": world, "model": settings.model.to_dict(), "fingerprint": resumable(fp)}
    resume = t.resume or t.resume_step is not None
    init = None if t.init_from is None else init_folder(t.init_from)  # the checkpoint's folder, checked once
    if init is not None:
        if resume:
            raise SettingError("--init-from starts a new run from a Hugging Face checkpoint; --resume continues a run: give one of them")
        differ = settings.model.differing(read_hf_config(init))
        if differ:
            raise SettingError(
                f"--init-from {t.init_from}: its config.json differs from the model this run builds (--model "
                f"{settings.model.name}) in {differ}: give --model {t.init_from}"
            )
    lock_outputs(settings, rank)
    if t.save_every and not resume:
        checkpoint.refuse_others(t.ckpt_dir, expect)
    if rank == 0:
        print(allows, flush=True)
    torch.manual_seed(settings.workload.seed)
    recompute = settings.costs.recompute
    dtype = compute_dtype(t.dtype, device)
    model = HybridMoE(settings.model, recompute).to(device=device, dtype=torch.float64 if dtype == "fp64" else torch.float32)
    if cost.ep_degree > 1:  # the cost model's EP degree is the runtime's: each rank keeps its slot's experts
        model.expert_parallel(cost.ep_degree, rank)
    timeout = datetime.timedelta(seconds=t.timeout)  # every group's collectives, not only the default group's
    if t.shard == "fsdp":
        shard_model(model, device, mixed_precision=dtype == "bf16", timeout=timeout)
    else:  # replicated: under expert parallelism the experts' gradients sum over their replicas
        replicate_experts(model, timeout)
    if init is not None:  # every rank reads the checkpoint and keeps its shards
        load_hf(model, init)
        if rank == 0:
            print(f"initialized from the Hugging Face checkpoint {t.init_from}", flush=True)
    if rank == 0:
        print(estimate, flush=True)
    o = settings.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
    total = settings.workload.steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: o.lr_factor(step, total))
    modes = modes_for(cost.sparse) if t.mode == "all" else [t.mode]  # all: every mode its sparse kind can run
    if rank == 0 and t.mode == "all" and len(modes) < len(MODES):
        left = [m for m in MODES if m not in modes]
        kind = settings.model.sparse_kind
        print(f"--mode all: sparse kind {kind!r} declares no reach, so {left} are left out (docs/extending.md)", flush=True)
    run = Run(settings, rank, world, device, cost, source, step_ids, modes, model, opt, sched, ExchangeGroups(world, timeout), fp)
    if resume:
        meta = checkpoint.load(t.ckpt_dir, model, opt, expect, t.resume_step)
        was = meta.get("ep_degree", cost.ep_degree)
        if was != cost.ep_degree and rank == 0:
            print(
                f"resumed a checkpoint written at EP{was} at EP{cost.ep_degree}: every expert was read from the whole layer's "
                f"tensors; the steps from here are planned and priced at EP{cost.ep_degree}",
                flush=True,
            )
        sched.load_state_dict(meta["scheduler"])
        run.start, run.rows = meta["step"], meta["rows"]
        if rank == 0:
            print(f"resumed from step {meta['step']} ({meta['path']})", flush=True)
    return run


def fingerprint(settings: Settings) -> dict:
    """Everything that must agree across the ranks of a run, and between a run and the checkpoint it
    resumes: the data (generator settings or files, seed), the schedule, the mode, the cluster, the
    planner. A step's data and plan follow from these and the step number (its plan hash is
    checked per step)."""
    t, wl = settings.train, settings.workload
    return {
        "mode": t.mode,
        "dtype": t.dtype,
        "optim": settings.optim.to_dict(),
        "planner": settings.planner.to_dict(),
        "costs": settings.costs.to_dict(),
        "cluster": settings.cluster.to_dict(),
        "workload": wl.to_dict(),
        "trace": file_identity(wl.trace),
        "tokens": file_identity(t.tokens),
        "doc_offsets": file_identity(t.doc_offsets),
        "replay": file_identity(os.path.join(t.replay, "summary.json")) if t.replay else None,
    }


LAYOUT_ONLY = ("ep_degree", "ep_placement")  # costs settings a checkpoint does not depend on (it holds every expert once)


def resumable(fp: dict) -> dict:
    """The fingerprint a resumed run must share with its checkpoint: the run's, less the experts'
    layout (a checkpoint written at one EP degree resumes at another)."""
    return {**fp, "costs": {k: v for k, v in fp["costs"].items() if k not in LAYOUT_ONLY}}


def agree_across_ranks(fp: dict, world: int) -> None:
    """Once, before step 1: every rank's fingerprint equals rank 0's, or every rank fails naming the
    first setting that differs and a rank that has it."""
    fps = [None] * world
    dist.all_gather_object(fps, fp)
    for r, other in enumerate(fps):
        bad = [k for k in fp if other.get(k) != fps[0].get(k)]
        if bad:
            k = bad[0]
            raise SettingError(
                f"ranks disagree on {k}: rank 0 has {fps[0].get(k)!r}, rank {r} has {other.get(k)!r} (start every rank alike)"
            )


def plan_step(run: Run, k: int):
    """Data and plans (one per mode) of the k-th step: a pure function of k, so it can be computed
    ahead in a thread while the previous step runs (a plan does not depend on when it is made)."""
    batch = run.source.get(run.step_ids[k])
    if sum(batch.lengths) == len(batch.lengths):
        raise InputError(
            f"step {batch.step}: every sample is one token long, so the step has no next-token label and no loss "
            f"(a larger --tokens-per-rank holds longer documents)"
        )
    try:
        samples = samples_from_lengths(batch.lengths)
        return batch, {m: make_plan(samples, run.cluster, run.cost, m, run.settings.planner.assignment_pricing) for m in run.modes}
    except PlanError as e:
        raise PlanError(f"step {run.step_ids[k]}: {e}") from None


def one_step(run: Run, plan, batch, mode: str) -> dict:
    """Forward, backward and (unless replaying every mode) the optimizer step; the measured row.
    Time is the slowest rank's; bytes are summed over ranks."""
    stats = CommStats(gpus_per_node=run.cluster.gpus_per_node, timed=run.options.timers)
    timers = {} if run.options.timers else None
    bf16 = compute_dtype(run.options.dtype, run.device) == "bf16"
    autocast = torch.bfloat16 if bf16 and run.options.shard == "none" else None  # fsdp: its bf16 parameters
    _sync(run.device)
    t0 = time.perf_counter()
    loss = run_step(
        run.model,
        plan,
        batch.tokens,
        run.groups,
        run.options.pack_backend,
        run.options.attn_backend,
        stats,
        autocast_dtype=autocast,
        timers=timers,
    )
    if run.options.mode != "all":
        run.opt.step()
        run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    _sync(run.device)
    dt = time.perf_counter() - t0
    # bytes by site, summed over ranks: the exchanges at full and sparse layers, the experts'
    # dispatch and combine (their slot counts left out: the simulator prices them as latency)
    # the results' byte columns: a family's sites each (the experts' slot counts left out, as the simulator prices them)
    sites = [sites_of(Family.FULL), sites_of(Family.SPARSE), sites_of(only=(Site.EXPERTS_DISPATCH, Site.EXPERTS_COMBINE))]
    counted = [f(keys) for keys in sites for f in (stats.intra_node_bytes, stats.inter_node_bytes)]
    b = torch.tensor(counted + [dt], dtype=torch.float64, device=run.device)
    dist.all_reduce(b[:6])
    dist.all_reduce(b[6:], op=dist.ReduceOp.MAX)
    dt = float(b[6])
    flops = run.cost.model_flops(batch.lengths)
    measured = {}
    if timers is not None:
        parts = {
            "host_s": timers["host"],
            "forward_s": timers["forward"],
            "backward_s": timers["backward"],
            "grad_sync_s": timers["grad_sync"],
            "exchange_full_s": stats.exchange_seconds(sites_of(Family.FULL)),
            "exchange_sparse_s": stats.exchange_seconds(sites_of(Family.SPARSE)),
            "exchange_moe_s": stats.exchange_seconds(sites_of(Family.EXPERTS)),
            "exchange_a2a_s": stats.exchange_seconds(EVERY_SITE, part="all_to_all"),
        }
        t = torch.tensor(list(parts.values()), dtype=torch.float64, device=run.device)
        dist.all_reduce(t)
        measured = dict(zip(parts, (t / run.world).tolist()))  # means over ranks
    return {
        **measured,
        "engine": "torch",
        "mode": mode,
        "step": batch.step,
        "n_samples": len(batch.lengths),
        "tokens": sum(batch.lengths),
        "longest": max(batch.lengths),
        "widest_parent": plan.widest_parent,
        **plan.parent_counts(),
        "step_time_s": dt,
        "mfu": flops / (dt * run.world * run.hw.peak_flops),
        "model_flops": flops,
        "full_intra_bytes": float(b[0]),
        "full_inter_bytes": float(b[1]),
        "sparse_intra_bytes": float(b[2]),
        "sparse_inter_bytes": float(b[3]),
        "moe_intra_bytes": float(b[4]),
        "moe_inter_bytes": float(b[5]),
        "plan_hash": plan.hash,
        "loss": float(loss),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def log_row(run: Run, row: dict) -> None:
    """One line per step from rank 0: loss, time, tokens/s, TFLOP/s, MFU and exchanged bytes."""
    if run.rank != 0:
        return
    dt, flops = row["step_time_s"], row["model_flops"]
    intra = row["full_intra_bytes"] + row["sparse_intra_bytes"]
    inter = row["full_inter_bytes"] + row["sparse_inter_bytes"]
    moe = row["moe_intra_bytes"] + row["moe_inter_bytes"]
    tqdm.write(
        f"step {row['step']:5d} {row['mode']:>13} loss {row['loss']:.6f} time {dt:.3f}s tok/s {row['tokens'] / dt:,.0f} "
        f"TFLOP/s {flops / dt / run.world / 1e12:.3f} MFU {100 * row['mfu']:.2f}% a2a intra {intra / 1e6:.2f} MB "
        f"inter {inter / 1e6:.2f} MB (sparse inter {row['sparse_inter_bytes'] / 1e6:.2f} MB), experts {moe / 1e6:.2f} MB",
        file=sys.stdout,
    )
    sys.stdout.flush()


def save(run: Run, k: int) -> None:
    """Checkpoint after the k-th step (every --save-every steps), collectively (experiments.train.checkpoint)."""
    if not run.options.save_every or k % run.options.save_every:
        return
    meta = {
        "model": run.cfg.to_dict(),
        "fingerprint": resumable(run.fingerprint),
        "ep_degree": run.cost.ep_degree,
        "scheduler": run.sched.state_dict(),
        "rows": run.rows,
        "settings": run.settings.to_dict(),
    }
    checkpoint.save(run.options.ckpt_dir, k, run.model, run.opt, meta)


def process_groups(run: Run) -> dict:
    """The exchanges' process groups the run made (every rank calls this: it gathers each rank's)."""
    mine = (sorted(run.groups.groups), run.groups.seconds)
    every = [None] * run.world
    dist.all_gather_object(every, mine)
    return {
        "new_group_calls": len(run.groups.made),
        "held": [[list(g) for g in held] for held, _ in every],  # per rank: (start, size) of each group it holds
        "seconds": [round(t, 6) for _, t in every],  # per rank: time spent making them
    }


def write_results(run: Run) -> None:
    groups = process_groups(run)
    if run.rank != 0:
        return
    summary = {
        "process_groups": groups,
        "engine": "torch",
        "provenance": provenance(),
        "config": run.settings.to_dict(),
        "selected_steps": list(run.step_ids[: run.stop]),
        "modes": summarize(run.rows) if run.rows else {},
        "paper": PAPER,
    }
    csv_path, json_path = write_run(run.options.out, run.rows, summary)
    print(f"wrote {csv_path} and {json_path}")


def train(settings: Settings, rank: int, device: torch.device) -> None:
    """Set up, then for every step: its plans (made one step ahead), one measured step per mode,
    a log line each, a checkpoint every --save-every steps; then the results.

    With --timers (a measurement run) the next step's plans are made before this step's, not
    beside it: on shared CPU cores the planning thread would slow whichever mode runs first. With
    --mode all the modes take turns running first, so no mode always pays what a step's start costs."""
    run = set_up(settings, rank, device)
    bar = tqdm(
        total=len(run.step_ids) * len(run.modes), initial=run.start * len(run.modes), disable=rank != 0, desc="train", file=sys.stderr
    )
    with ThreadPoolExecutor(max_workers=1) as ahead:
        pending = ahead.submit(plan_step, run, run.start) if run.start < run.stop else None
        for k in range(run.start, run.stop):
            batch, plans = pending.result()
            pending = ahead.submit(plan_step, run, k + 1) if k + 1 < run.stop else None
            if pending is not None and run.options.timers:
                pending.result()  # made now, so it does not run beside the timed steps
            turn = k % len(run.modes)
            order = run.modes[turn:] + run.modes[:turn]
            # --repeats rounds over the modes, the fastest of each mode's runs kept (every rank agrees:
            # step times are the slowest rank's); rounds, not a mode's runs back to back, so a slow
            # spell of a shared machine falls on every mode alike
            best = {}
            for _ in range(run.options.repeats):
                for mode in order:
                    row = one_step(run, plans[mode], batch, mode)
                    if mode not in best or row["step_time_s"] < best[mode]["step_time_s"]:
                        best[mode] = row
            for mode in order:
                run.rows.append(best[mode])
                log_row(run, best[mode])
                bar.update(1)
            bad = [m for m in order if not math.isfinite(best[m]["loss"])]
            if bad and not run.options.allow_nonfinite:  # every rank sees the same loss (a sum over ranks): all stop here
                write_results(run)
                kept = checkpoint.checkpoints(run.options.ckpt_dir)[:1] if run.options.save_every else []
                raise NonFiniteLoss(
                    f"step {batch.step} ({bad[0]}): the loss is {best[bad[0]]['loss']}; the run stops here, its results so far "
                    f"written, {'its last checkpoint ' + kept[0] + ' kept' if kept else 'no checkpoint written'} "
                    f"(--allow-nonfinite goes on)"
                )
            save(run, k + 1)
    bar.close()
    write_results(run)
    if run.options.save_hf is not None:
        save_hf(run.model, run.options.save_hf)
        if rank == 0:
            print(f"wrote a Hugging Face checkpoint of the final weights in {run.options.save_hf}", flush=True)
