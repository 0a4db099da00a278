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
import math
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from kernels.exchange import AlignedGroups, CommStats
from model import HybridMoE
from model.distributed import run_step
from solver import MODES, Cluster, CostModel, HardwareConfig, ModelConfig, PlanError, make_plan, samples_from_lengths
from solver.context import run_context
from solver.workload import WorkloadConfig, generate_steps, load_trace

from .ablation import add_baseline_pricing_arg
from .data import LengthSource, TokenFileSource
from .results import PAPER, summarize, write_run

TINY_WORKLOAD = dict(tokens_per_step=160, body_median=8, body_sigma=0.8, body_min=1, body_max=40, long_prob=0.04, long_min=48, long_max=120)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--mode",
        default="repack+solver",
        choices=list(MODES) + ["all"],
        help="layout mode; 'all' runs every step in the three modes without optimizer updates (replay)",
    )
    ap.add_argument("--model", default="tiny", help="model preset: tiny (CPU), small (GPU cluster), paper (cost model only)")
    ap.add_argument("--hardware", default="h100", help="hardware preset, for MFU's peak FLOP/s")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpus-per-node", type=int, default=None, help="default: LOCAL_WORLD_SIZE from the launcher")
    ap.add_argument("--tokens-per-rank", type=int, default=None, help="per-rank token budget (default 32 for tiny, 32768 otherwise)")
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
    ap.add_argument("--attn-backend", default="auto", choices=["auto", "torch", "flash", "kernel"])
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: never)")
    ap.add_argument("--ckpt-dir", default="results/checkpoints")
    ap.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --ckpt-dir")
    ap.add_argument("--stop-after", type=int, default=None, help="stop (as if interrupted) after this many steps of the run")
    ap.add_argument("--out", default="results/train", help="results folder")
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a stuck collective fails the job")
    return ap.parse_args(argv)


# ----- checkpoints ------------------------------------------------------------------------------
def save_checkpoint(ckpt_dir: str, step: int, model, opt, sched, extra: dict) -> str:
    """Write step_<N>.pt via a temporary file and os.replace, then point `latest` at it the same
    way: a crash at any moment leaves the previous checkpoint as the one that loads."""
    os.makedirs(ckpt_dir, exist_ok=True)
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        **extra,
    }
    path = os.path.join(ckpt_dir, f"step_{step:07d}.pt")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    latest = os.path.join(ckpt_dir, "latest")
    with open(latest + ".tmp", "w") as f:
        f.write(os.path.basename(path))
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest + ".tmp", latest)
    return path


def load_checkpoint(ckpt_dir: str) -> dict:
    latest = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(latest):
        raise PlanError(f"--resume: no checkpoint in {ckpt_dir!r} (no 'latest' file)")
    with open(latest) as f:
        name = f.read().strip()
    return torch.load(os.path.join(ckpt_dir, name), weights_only=False)


# ----- set-up -----------------------------------------------------------------------------------
def lr_lambda(warmup: int, total: int):
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


def build_source(args, cfg: ModelConfig, world: int):
    if args.tokens:
        if not args.doc_offsets:
            raise PlanError("--tokens needs --doc-offsets (document boundaries)")
        return TokenFileSource(args.tokens, args.doc_offsets, args.tokens_per_step or 16384 * world, cfg.vocab), None
    if args.trace:
        return LengthSource(load_trace(args.trace), cfg.vocab, args.seed), None
    shape = args.workload or ("tiny" if cfg.name == "tiny" else "default")
    over = dict(TINY_WORKLOAD) if shape == "tiny" else {"tokens_per_step": 16384 * world}
    if args.tokens_per_step:
        over["tokens_per_step"] = args.tokens_per_step
    wl = dataclasses.replace(WorkloadConfig(), **over, seed=args.seed, steps=args.steps)
    return LengthSource(generate_steps(wl), cfg.vocab, args.seed), wl


def replay_steps(folder: str) -> tuple[list[list[int]], list[int], dict]:
    import json

    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    cfg = summary["config"]
    wl = WorkloadConfig(**cfg["workload"])
    steps = load_trace(cfg["trace"]) if cfg.get("trace") else generate_steps(wl)
    return steps, summary["selected_steps"], cfg


def main(argv=None):
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
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


def train(args, rank: int, world: int, device: torch.device):
    cfg = ModelConfig.from_name(args.model)
    gpn = args.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    budget = args.tokens_per_rank or (32 if cfg.name == "tiny" else 32768)
    cluster = Cluster(world, gpn, budget)
    hw = HardwareConfig.from_name(args.hardware, gpus_per_node=gpn)
    cost = CostModel(cfg, hw)
    if args.replay:
        all_steps, selected, abl_cfg = replay_steps(args.replay)
        args.baseline_pricing = abl_cfg.get("baseline_pricing", args.baseline_pricing)  # replay what the ablation planned
        source, wl = LengthSource(all_steps, cfg.vocab, args.seed), None
        step_ids = selected
    else:
        source, wl = build_source(args, cfg, world)
        step_ids = list(range(min(args.steps, len(source))))
    modes = list(MODES) if args.mode == "all" else [args.mode]
    dtype = torch.float64 if args.dtype == "fp64" else torch.float32
    torch.manual_seed(args.seed)
    model = HybridMoE(cfg).to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=tuple(args.betas), weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, args.steps))
    start = 0
    rows = []
    if args.resume:
        state = load_checkpoint(args.ckpt_dir)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        start = state["step"]
        rows = state.get("rows", [])
    groups = AlignedGroups(world)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    bar = tqdm(total=len(step_ids) * len(modes), initial=start * len(modes), disable=rank != 0, desc="train", file=sys.stderr)
    stop = len(step_ids) if args.stop_after is None else min(len(step_ids), args.stop_after)

    def prepare(k):
        """Data and plans of step k: a pure function of k, computed one step ahead in a thread so
        that planning overlaps the running step (the plan does not depend on when it is made)."""
        batch = source.get(step_ids[k])
        try:
            lengths = samples_from_lengths(batch.lengths)
            return batch, {m: make_plan(lengths, cluster, cost, m, args.baseline_pricing) for m in modes}
        except PlanError as e:
            raise PlanError(f"step {step_ids[k]}: {e}") from None

    ahead = ThreadPoolExecutor(max_workers=1)
    pending = ahead.submit(prepare, start) if start < stop else None
    for k in range(start, stop):
        step = step_ids[k]
        batch, plans = pending.result()
        pending = ahead.submit(prepare, k + 1) if k + 1 < stop else None
        for mode in modes:
            plan = plans[mode]
            stats = CommStats(gpus_per_node=gpn)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = run_step(model, plan, batch.tokens, groups, args.pack_path, args.attn_backend, stats, autocast_dtype=autocast)
            if args.mode != "all":
                opt.step()
                sched.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            b = torch.tensor(
                [
                    stats.intra_node_bytes("full"),
                    stats.inter_node_bytes("full"),
                    stats.intra_node_bytes("sparse"),
                    stats.inter_node_bytes("sparse"),
                    dt,
                ],
                dtype=torch.float64,
                device=device,
            )
            dist.all_reduce(b[:4])
            dist.all_reduce(b[4:], op=dist.ReduceOp.MAX)
            dt = float(b[4])
            flops = cost.model_flops(batch.lengths)
            row = {
                "engine": "torch",
                "mode": mode,
                "step": step,
                "n_samples": len(batch.lengths),
                "tokens": sum(batch.lengths),
                "longest": max(batch.lengths),
                "widest_parent": plan.widest_parent,
                "wide_parents": len(plan.wide_parents()),
                "repacked_parents": sum(p.repacked for p in plan.parents),
                "step_time_s": dt,
                "mfu": flops / (dt * world * hw.peak_flops),
                "model_flops": flops,
                "full_intra_bytes": float(b[0]),
                "full_inter_bytes": float(b[1]),
                "sparse_intra_bytes": float(b[2]),
                "sparse_inter_bytes": float(b[3]),
                "plan_hash": plan.hash,
                "loss": float(loss),
            }
            rows.append(row)
            if rank == 0:
                tqdm.write(
                    f"step {step:5d} {mode:>13} loss {row['loss']:.6f} time {dt:.3f}s tok/s {row['tokens'] / dt:,.0f} "
                    f"TFLOP/s {flops / dt / world / 1e12:.3f} MFU {100 * row['mfu']:.2f}% a2a intra "
                    f"{(b[0] + b[2]) / 1e6:.2f} MB inter {(b[1] + b[3]) / 1e6:.2f} MB (sparse inter {b[3] / 1e6:.2f} MB)",
                    file=sys.stdout,
                )
                sys.stdout.flush()
            bar.update(1)
        if args.save_every and (k + 1) % args.save_every == 0 and rank == 0:
            save_checkpoint(args.ckpt_dir, k + 1, model, opt, sched, {"rows": rows, "args": vars(args)})
        if args.save_every and (k + 1) % args.save_every == 0:
            dist.barrier()
    bar.close()
    ahead.shutdown()
    if rank == 0:
        summary = {
            "engine": "torch",
            "context": run_context(),
            "config": {
                "model": cfg.to_dict(),
                "hardware": hw.to_dict(),
                "cluster": dataclasses.asdict(cluster),
                "workload": wl.to_dict() if wl else None,
                "trace": args.trace,
                "tokens_file": args.tokens,
                "args": {k: v for k, v in vars(args).items()},
            },
            "selected_steps": step_ids,
            "modes": summarize(rows) if rows else {},
            "paper": PAPER,
        }
        csv_path, json_path = write_run(args.out, rows, summary)
        print(f"wrote {csv_path} and {json_path}")


if __name__ == "__main__":
    main()
