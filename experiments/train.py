"""Training driver: one process per GPU under torchrun (NCCL), or per CPU rank (gloo).

    # this machine: 8 CPU ranks emulating 4 nodes of 2, tiny model
    torchrun --nproc-per-node 8 -m experiments.train --model tiny --workload tiny --gpus-per-node 2 --steps 20
    # a 4-node x 8-GPU cluster (run on every node)
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        -m experiments.train --model small --mode repack+solver --steps 200

Every rank computes each step's plan from the same data; the plans' hashes are compared across
ranks before any exchange. One log line per step from rank 0; results per step in the schema of
experiments.results (engine "torch"); checkpoints saved atomically every --save-every steps.
A failing rank prints its rank and reason and exits non-zero; torchrun then ends the job, and
collectives time out after --timeout seconds rather than hang.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tqdm import tqdm

from kernels.exchange import AlignedGroups, CommStats
from model import HybridMoE
from model.attention import BACKENDS
from model.distributed import run_step
from model.sharding import SHARDINGS, shard_model
from solver import MODES, Cluster, CostModel, HardwareConfig, ModelConfig, PlanError, check_setup, make_plan, samples_from_lengths
from solver.config import RECOMPUTE, TrainingConfig

from . import checkpoint, memory
from .ablation import add_baseline_pricing_arg
from .context import run_context
from .data import LengthSource, TokenFileSource
from .results import PAPER, summarize, write_run
from .settings import check_output_dir
from .workload import DEFAULT_TOKENS_PER_RANK, WorkloadConfig, default_tokens_per_step, generate_steps, load_trace

TINY_TOKENS_PER_RANK = 32  # the tiny model's per-rank budget: a CPU step in well under a second
TINY_WORKLOAD = dict(body_median=8, body_sigma=0.8, body_min=1, body_max=40, long_prob=0.04, long_min=48, long_max=120)


def tiny_workload(world: int, tokens_per_rank: int, longest: int) -> dict:
    """The tiny workload sized to the cluster: 5/8 of its tokens per step (160 on 8 ranks of 32)
    and no sample longer than its widest group holds (`longest`), so it runs on any world size."""
    w = dict(TINY_WORKLOAD, tokens_per_step=max(1, world * tokens_per_rank * 5 // 8))
    w["long_max"] = min(w["long_max"], longest)
    w["long_min"] = min(w["long_min"], w["long_max"])
    w["body_max"] = min(w["body_max"], w["long_max"])
    w["body_min"] = min(w["body_min"], w["body_max"])
    return w


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--mode",
        default="repack+solver",
        choices=list(MODES) + ["all"],
        help="layout mode; 'all' runs every step in every mode without optimizer updates (replay)",
    )
    ap.add_argument("--model", default="tiny", help="model preset: tiny (CPU), small (GPU cluster), paper (cost model only)")
    ap.add_argument("--hardware", default="h100", help="hardware preset, for MFU's peak FLOP/s")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpus-per-node", type=int, default=None, help="default: LOCAL_WORLD_SIZE from the launcher")
    ap.add_argument(
        "--tokens-per-rank",
        type=int,
        default=None,
        help=f"per-rank token budget (default {TINY_TOKENS_PER_RANK} for tiny, {DEFAULT_TOKENS_PER_RANK} otherwise)",
    )
    ap.add_argument("--workload", default=None, choices=["tiny", "default"], help="synthetic workload (default: tiny for the tiny model)")
    ap.add_argument("--tokens-per-step", type=int, default=None, help="global batch in tokens of the synthetic workload")
    ap.add_argument("--trace", default=None, help="length trace (.csv/.jsonl/.npy) instead of the generator (random tokens)")
    ap.add_argument("--tokens", default=None, help="token file: .npy of uint16/uint32 ids (memory-mapped)")
    ap.add_argument("--doc-offsets", default=None, help="document offsets .npy [n_docs + 1] for --tokens")
    add_baseline_pricing_arg(ap)
    ap.add_argument("--replay", default=None, help="an ablation results folder: run its selected steps (use --mode all)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    ap.add_argument("--warmup", type=int, default=5, help="linear warmup steps, then cosine decay to 10%%")
    ap.add_argument("--dtype", default=None, choices=["fp32", "fp64"], help="parameter dtype (default fp32); bf16 autocast on CUDA")
    ap.add_argument("--pack-path", default="auto", choices=["auto", "triton", "torch"])
    ap.add_argument("--attn-backend", default="auto", choices=list(BACKENDS), help="auto: flash-attn, else varlen, on CUDA")
    ap.add_argument(
        "--shard", default="fsdp", choices=list(SHARDINGS), help="fsdp: FSDP2 over every rank; none: replicated, bucketed all-reduce"
    )
    ap.add_argument(
        "--recompute",
        default="full",
        choices=list(RECOMPUTE),
        help="activation recompute, as the cost model prices it (TrainingConfig.recompute, default full)",
    )
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    ap.add_argument("--ckpt-dir", default="results/checkpoints")
    ap.add_argument("--resume", action="store_true", help="resume from the latest good checkpoint in --ckpt-dir")
    ap.add_argument("--resume-step", type=int, default=None, help="resume from this step's checkpoint (implies --resume)")
    ap.add_argument("--stop-after", type=int, default=None, help="stop (as if interrupted) after this many steps of the run")
    ap.add_argument("--out", default="results/train", help="results folder")
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a stuck collective fails the job")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with --mode all: run each step in each mode this many times and keep the fastest (a measurement run)",
    )
    ap.add_argument(
        "--timers",
        action="store_true",
        help="time each step's phases and exchanges (device synchronized around each: a measurement run)",
    )
    args = ap.parse_args(argv)
    if args.resume_step is not None:
        args.resume = True
    return args


def check_args(args) -> None:
    """The driver's own flags, before any process group or work: one PlanError naming the value."""
    ints = {"--steps": (args.steps, 1), "--save-every": (args.save_every, 0), "--warmup": (args.warmup, 0), "--repeats": (args.repeats, 1)}
    ints |= {f: (v, 1) for f, v in (("--stop-after", args.stop_after), ("--tokens-per-rank", args.tokens_per_rank)) if v is not None}
    ints |= {f: (v, 1) for f, v in (("--tokens-per-step", args.tokens_per_step), ("--gpus-per-node", args.gpus_per_node)) if v is not None}
    if args.resume_step is not None:
        ints["--resume-step"] = (args.resume_step, 0)
    for flag, (v, least) in ints.items():
        if v < least:
            raise PlanError(f"{flag}={v} is invalid: use an integer >= {least}")
    for flag, v in (("--timeout", args.timeout), ("--lr", args.lr)):
        if not (math.isfinite(v) and v > 0):
            raise PlanError(f"{flag}={v} is invalid: use a number > 0")
    if args.repeats > 1 and args.mode != "all":
        raise PlanError(f"--repeats={args.repeats} needs --mode all (no optimizer step between repeats); got --mode {args.mode}")
    check_output_dir(args.out, "--out")
    if args.save_every or args.resume:
        check_output_dir(args.ckpt_dir, "--ckpt-dir")


# ----- set-up -----------------------------------------------------------------------------------
def lr_lambda(warmup: int, total: int):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


def build_source(args, cfg: ModelConfig, cluster: Cluster, cost: CostModel):
    if args.tokens:
        if not args.doc_offsets:
            raise PlanError("--tokens needs --doc-offsets (document boundaries)")
        tokens_per_step = args.tokens_per_step or default_tokens_per_step(cluster.world_size)
        return TokenFileSource(args.tokens, args.doc_offsets, tokens_per_step, cfg.vocab), None
    if args.trace:
        steps = load_trace(args.trace)
        return LengthSource([lengths for _, lengths in steps], cfg.vocab, args.seed, [n for n, _ in steps]), None
    shape = args.workload or ("tiny" if cfg.name.startswith("tiny") else "default")
    if shape == "tiny":
        over = tiny_workload(cluster.world_size, cluster.tokens_per_rank, cost.widest_group(cluster) * cluster.tokens_per_rank)
    else:
        over = {"tokens_per_step": default_tokens_per_step(cluster.world_size)}
    if args.tokens_per_step:
        over["tokens_per_step"] = args.tokens_per_step
    wl = dataclasses.replace(WorkloadConfig(), **over, seed=args.seed, steps=args.steps)
    return LengthSource(generate_steps(wl), cfg.vocab, args.seed), wl


def replay_steps(folder: str, seed: int | None = None) -> tuple[list[list[int]], list[int], list[int], dict]:
    """An ablation run's data (its first seed's, or `seed`'s): every step's lengths and number,
    the positions of the selected steps, and the ablation's config."""
    import json

    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    cfg = summary["config"]
    selected = summary["selected_steps"]
    seed = cfg["seeds"][0] if seed is None else seed
    if str(seed) not in selected:
        raise PlanError(f"--replay {folder!r} has no seed {seed}; its seeds: {sorted(selected)}")
    if cfg.get("trace"):
        steps = load_trace(cfg["trace"])
    else:
        steps = list(enumerate(generate_steps(WorkloadConfig.from_dict({**cfg["workload"], "seed": seed}))))
    position = {n: i for i, (n, _) in enumerate(steps)}
    return [lengths for _, lengths in steps], [n for n, _ in steps], [position[n] for n in selected[str(seed)]], cfg


def main(argv=None):
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        check_args(args)
    except PlanError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    if "MASTER_ADDR" not in os.environ:  # a plain `python -m experiments.train`: one rank
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        train(args, rank, world, torch.device(f"cuda:{local}" if cuda else "cpu"))
    except Exception as e:  # noqa: BLE001 - every failure ends the job with its rank and reason
        print(f"[rank {rank}] failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()


@dataclass
class Run:
    """Everything one rank sets up before step 1."""

    args: argparse.Namespace
    rank: int
    world: int
    device: torch.device
    cfg: ModelConfig
    cluster: Cluster
    hw: HardwareConfig
    cost: CostModel
    source: object  # LengthSource or TokenFileSource
    workload: WorkloadConfig | None
    step_ids: list[int]  # the data steps this run trains on, in order
    modes: list[str]
    model: HybridMoE
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    groups: AlignedGroups
    fingerprint: dict
    start: int = 0  # index into step_ids of the first step to run (after a resume)
    rows: list[dict] = field(default_factory=list)

    @property
    def stop(self) -> int:
        return len(self.step_ids) if self.args.stop_after is None else min(len(self.step_ids), self.args.stop_after)


def set_up(args, rank: int, world: int, device: torch.device) -> Run:
    """Model, cluster, data, optimizer and process groups; restored from a checkpoint on --resume."""
    cfg = ModelConfig.from_name(args.model)
    gpn = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    budget = args.tokens_per_rank or (TINY_TOKENS_PER_RANK if cfg.name.startswith("tiny") else DEFAULT_TOKENS_PER_RANK)
    cluster = Cluster(world, gpn, budget)
    hw = HardwareConfig.from_name(args.hardware)
    cost = CostModel(cfg, hw).for_cluster(cluster)
    if args.replay:
        all_steps, numbers, step_ids, abl_cfg = replay_steps(args.replay)
        args.baseline_pricing = abl_cfg["baseline_pricing"]  # replay what the ablation planned
        if abl_cfg["model"]["name"] == cfg.name:  # the same model: plan with the ablation's training costs too (the same plans)
            cost = CostModel(cfg, hw, training=TrainingConfig(**abl_cfg["training"])).for_cluster(cluster)
        source, wl = LengthSource(all_steps, cfg.vocab, args.seed, numbers), None
    else:
        source, wl = build_source(args, cfg, cluster, cost)
        step_ids = list(range(min(args.steps, len(source))))
    try:  # the model against the cluster, and every step against both, before step 1
        allows = check_setup(cluster, cost, (source.lengths(k) for k in step_ids))
    except PlanError as e:
        raise PlanError(f"{e} (flags: --tokens-per-rank, --tokens-per-step, --gpus-per-node, --model)") from None
    if rank == 0:
        print(allows, flush=True)
    fp = fingerprint(args, cluster, wl)
    agree_across_ranks(fp, world)
    torch.manual_seed(args.seed)
    model = HybridMoE(cfg, args.recompute).to(device=device, dtype=torch.float64 if args.dtype == "fp64" else torch.float32)
    if args.shard == "fsdp":
        shard_model(model, device)
    if rank == 0:
        print(memory.summary(cfg, world, budget, args.shard, device.type == "cuda", args.recompute), flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=tuple(args.betas), weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, args.steps))
    modes = list(MODES) if args.mode == "all" else [args.mode]
    run = Run(args, rank, world, device, cfg, cluster, hw, cost, source, wl, step_ids, modes, model, opt, sched, AlignedGroups(world), fp)
    if args.resume:
        expect = {"world_size": world, "model": cfg.to_dict(), "fingerprint": fp}
        meta = checkpoint.load(args.ckpt_dir, model, opt, expect, args.resume_step)
        sched.load_state_dict(meta["scheduler"])
        run.start, run.rows = meta["step"], meta["rows"]
    return run


def _file_id(path: str | None) -> dict | None:
    """A data file's identity: its size and the sha256 of its first and last MiB (a token file may
    be many GB; the same file copied to every node gives the same identity)."""
    if not path:
        return None
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return {"name": os.path.basename(path), "bytes": size, "sha256_ends": h.hexdigest()[:16]}


def fingerprint(args, cluster: Cluster, wl: WorkloadConfig | None) -> dict:
    """Everything that must agree across the ranks of a run, and between a run and the checkpoint it
    resumes: the data (generator settings or files, seed), the schedule, the mode, the cluster. A
    step's data and plan follow from these and the step number (its plan hash is checked per step)."""
    return {
        "seed": args.seed,
        "mode": args.mode,
        "steps": args.steps,
        "lr": args.lr,
        "warmup": args.warmup,
        "betas": list(args.betas),
        "weight_decay": args.weight_decay,
        "dtype": args.dtype or "fp32",
        "baseline_pricing": args.baseline_pricing,
        "world_size": cluster.world_size,
        "gpus_per_node": cluster.gpus_per_node,
        "tokens_per_rank": cluster.tokens_per_rank,
        "workload": wl.to_dict() if wl else None,
        "trace": _file_id(args.trace),
        "tokens": _file_id(args.tokens),
        "doc_offsets": _file_id(args.doc_offsets),
        "replay": _file_id(os.path.join(args.replay, "summary.json")) if args.replay else None,
    }


def agree_across_ranks(fp: dict, world: int) -> None:
    """Once, before step 1: every rank's fingerprint equals rank 0's, or every rank fails naming the
    first setting that differs and a rank that has it."""
    fps = [None] * world
    dist.all_gather_object(fps, fp)
    for r, other in enumerate(fps):
        bad = [k for k in fp if other.get(k) != fps[0].get(k)]
        if bad:
            k = bad[0]
            raise PlanError(f"ranks disagree on {k}: rank 0 has {fps[0].get(k)!r}, rank {r} has {other.get(k)!r} (start every rank alike)")


def plan_step(run: Run, k: int):
    """Data and plans (one per mode) of the k-th step: a pure function of k, so it can be computed
    ahead in a thread while the previous step runs (a plan does not depend on when it is made)."""
    batch = run.source.get(run.step_ids[k])
    try:
        samples = samples_from_lengths(batch.lengths)
        return batch, {m: make_plan(samples, run.cluster, run.cost, m, run.args.baseline_pricing) for m in run.modes}
    except PlanError as e:
        raise PlanError(f"step {run.step_ids[k]}: {e}") from None


def one_step(run: Run, plan, batch, mode: str) -> dict:
    """Forward, backward and (unless replaying every mode) the optimizer step; the measured row.
    Time is the slowest rank's; bytes are summed over ranks."""
    stats = CommStats(gpus_per_node=run.cluster.gpus_per_node, timed=run.args.timers)
    timers = {} if run.args.timers else None
    autocast = torch.bfloat16 if run.device.type == "cuda" and run.args.shard == "none" else None  # fsdp: bf16 parameters
    _sync(run.device)
    t0 = time.perf_counter()
    loss = run_step(
        run.model, plan, batch.tokens, run.groups, run.args.pack_path, run.args.attn_backend, stats, autocast_dtype=autocast, timers=timers
    )
    if run.args.mode != "all":
        run.opt.step()
        run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    _sync(run.device)
    dt = time.perf_counter() - t0
    sites = [(s, f) for s in ("full", "sparse") for f in (stats.intra_node_bytes, stats.inter_node_bytes)]
    b = torch.tensor([f(s) for s, f in sites] + [dt], dtype=torch.float64, device=run.device)
    dist.all_reduce(b[:4])
    dist.all_reduce(b[4:], op=dist.ReduceOp.MAX)
    dt = float(b[4])
    flops = run.cost.model_flops(batch.lengths)
    measured = {}
    if timers is not None:
        parts = {
            "host_s": timers["host"],
            "forward_s": timers["forward"],
            "backward_s": timers["backward"],
            "grad_sync_s": timers["grad_sync"],
            "exchange_full_s": stats.exchange_seconds("full"),
            "exchange_sparse_s": stats.exchange_seconds("sparse"),
            "exchange_a2a_s": stats.exchange_seconds("", part="all_to_all"),
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
        "wide_parents": len(plan.wide_parents()),
        "repacked_parents": sum(p.repacked for p in plan.parents),
        "step_time_s": dt,
        "mfu": flops / (dt * run.world * run.hw.peak_flops),
        "model_flops": flops,
        "full_intra_bytes": float(b[0]),
        "full_inter_bytes": float(b[1]),
        "sparse_intra_bytes": float(b[2]),
        "sparse_inter_bytes": float(b[3]),
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
    tqdm.write(
        f"step {row['step']:5d} {row['mode']:>13} loss {row['loss']:.6f} time {dt:.3f}s tok/s {row['tokens'] / dt:,.0f} "
        f"TFLOP/s {flops / dt / run.world / 1e12:.3f} MFU {100 * row['mfu']:.2f}% a2a intra {intra / 1e6:.2f} MB "
        f"inter {inter / 1e6:.2f} MB (sparse inter {row['sparse_inter_bytes'] / 1e6:.2f} MB)",
        file=sys.stdout,
    )
    sys.stdout.flush()


def save(run: Run, k: int) -> None:
    """Checkpoint after the k-th step (every --save-every steps), collectively (experiments.checkpoint)."""
    if not run.args.save_every or k % run.args.save_every:
        return
    meta = {
        "model": run.cfg.to_dict(),
        "fingerprint": run.fingerprint,
        "scheduler": run.sched.state_dict(),
        "rows": run.rows,
        "args": vars(run.args),
    }
    checkpoint.save(run.args.ckpt_dir, k, run.model, run.opt, meta)


def write_results(run: Run) -> None:
    if run.rank != 0:
        return
    summary = {
        "engine": "torch",
        "context": run_context(),
        "config": {
            "model": run.cfg.to_dict(),
            "hardware": run.hw.to_dict(),
            "cluster": dataclasses.asdict(run.cluster),
            "workload": run.workload.to_dict() if run.workload else None,
            "trace": run.args.trace,
            "tokens_file": run.args.tokens,
            "args": dict(vars(run.args)),
        },
        "selected_steps": run.step_ids,
        "modes": summarize(run.rows) if run.rows else {},
        "paper": PAPER,
    }
    csv_path, json_path = write_run(run.args.out, run.rows, summary)
    print(f"wrote {csv_path} and {json_path}")


def train(args, rank: int, world: int, device: torch.device) -> None:
    """Set up, then for every step: its plans (made one step ahead), one measured step per mode,
    a log line each, a checkpoint every --save-every steps; then the results.

    With --timers (a measurement run) the next step's plans are made before this step's, not
    beside it: on shared CPU cores the planning thread would slow whichever mode runs first. With
    --mode all the modes take turns running first, so no mode always pays what a step's start costs."""
    run = set_up(args, rank, world, device)
    bar = tqdm(
        total=len(run.step_ids) * len(run.modes), initial=run.start * len(run.modes), disable=rank != 0, desc="train", file=sys.stderr
    )
    with ThreadPoolExecutor(max_workers=1) as ahead:
        pending = ahead.submit(plan_step, run, run.start) if run.start < run.stop else None
        for k in range(run.start, run.stop):
            batch, plans = pending.result()
            pending = ahead.submit(plan_step, run, k + 1) if k + 1 < run.stop else None
            if pending is not None and run.args.timers:
                pending.result()  # made now, so it does not run beside the timed steps
            turn = k % len(run.modes)
            order = run.modes[turn:] + run.modes[:turn]
            # --repeats rounds over the modes, the fastest of each mode's runs kept (every rank agrees:
            # step times are the slowest rank's); rounds, not a mode's runs back to back, so a slow
            # spell of a shared machine falls on every mode alike
            best = {}
            for _ in range(run.args.repeats):
                for mode in order:
                    row = one_step(run, plans[mode], batch, mode)
                    if mode not in best or row["step_time_s"] < best[mode]["step_time_s"]:
                        best[mode] = row
            for mode in order:
                run.rows.append(best[mode])
                log_row(run, best[mode])
                bar.update(1)
            save(run, k + 1)
    bar.close()
    write_results(run)


if __name__ == "__main__":
    main()
