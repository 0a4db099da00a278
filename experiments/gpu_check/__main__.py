"""The checks that need a GPU, as one prepared run (a few minutes on one H100/H200).

    python3 -m experiments.gpu_check --out results/gpu_check     # on a CUDA machine
    python3 -m experiments.gpu_check --cpu-smoke                  # here: check 1 only, interpreted

1. Triton pack/unpack against the torch reference on CUDA tensors, bit for bit, with every fresh
   buffer NaN-poisoned: fp32/bf16/fp16, head dims 1/63/128, Q+K+V (GQA) head_counts, the entry and
   exit exchanges of solver plans in every mode.
2. The kernel benchmark (experiments.bench.kernels) with the targets checked: at 64 MB and more,
   Triton at least 80% of the device-copy bandwidth and faster than the torch path.
3. flash-attn (when installed) and torch's varlen attention against the torch path
   (tests/test_attention.py -k cuda_backend).
4. Three training steps of the tiny model on one GPU under torchrun (NCCL, bf16 autocast,
   Triton pack path), repack+solver mode.

Writes <out>/gpu_check.json (figures, device, commit) and exits 1 if any check fails.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import torch

from config import MODES, Cluster, HardwareConfig, ModelConfig
from config.base import Section, setting
from config.cli import Command
from experiments.common import options
from experiments.common.errors import USER_ERRORS
from experiments.common.provenance import provenance
from kernels.exchange import exchange_args
from kernels.permute import gather_heads, scatter_heads
from kernels.reference import nan_poisoned_empty
from solver import CostModel, head_to_token_plan, make_plan, samples_from_lengths, token_to_head_plan

TARGET_COPY_FRACTION = 0.8
TARGET_MIN_MB = 64.0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _plans(world: int, gpus_per_node: int, budget: int, seed: int, modes=MODES):
    cost = CostModel(ModelConfig.from_name("tiny"), HardwareConfig())
    rng = np.random.default_rng(seed)
    cluster = Cluster(world, gpus_per_node, budget)
    lengths = [int(n) for n in np.clip(rng.lognormal(np.log(budget / 4), 1.0, 8 * world), 1, budget // 2)]
    lengths = [world * budget // 3] + lengths  # one sample wide enough for a parent across nodes
    while sum(lengths) > 0.7 * world * budget:
        lengths.pop()
    samples = samples_from_lengths(lengths)
    return [make_plan(samples, cluster, cost, mode) for mode in modes]


def check_bit_exact(device: torch.device, quick: bool) -> dict:
    """Every rank's entry and exit exchange of each plan, both kernels, against the reference.
    quick (the CPU smoke): one small repacked plan, one dtype and head size; the tests cover the
    kernels themselves (test_kernels), this shows the script runs."""
    world, g, budget = (4, 2, 128) if quick else (32, 8, 4096)
    dims = (63,) if quick else (1, 63, 128)
    dtypes = ("bf16",) if quick else tuple(DTYPES)
    heads = 32
    compared, failures = 0, []
    with nan_poisoned_empty():
        for plan in _plans(world, g, budget, seed=0, modes=("repack",) if quick else MODES):
            head_counts = [heads] if plan.widest_parent > 8 else [heads, 8, 8]
            entry = token_to_head_plan(plan.child_layout, plan.parent_layout)
            exit_ = head_to_token_plan(plan.parent_layout, plan.child_layout)
            for kind, ex in (("entry", entry), ("exit", exit_)):
                for r in range(world):
                    a = exchange_args(ex[r], head_counts, device)
                    for dt in dtypes:
                        for dim in dims:
                            x = torch.randn(a.n_in, a.in_heads, dim, device=device).to(DTYPES[dt])
                            ref = gather_heads(x, a.pack_rows, a.pack_peers, a.pack_map, "torch")
                            tri = gather_heads(x, a.pack_rows, a.pack_peers, a.pack_map, "triton")
                            recv = torch.randn(int(sum(a.recv_counts)), a.pack_map.shape[1], dim, device=device).to(DTYPES[dt])
                            args = (a.unpack_rows, a.unpack_peers, a.unpack_map, a.n_out, a.out_heads)
                            ref_u, tri_u = scatter_heads(recv, *args, "torch"), scatter_heads(recv, *args, "triton")
                            compared += 2
                            for name, t, rr in (("pack", tri, ref), ("unpack", tri_u, ref_u)):
                                if torch.isnan(t).any() or not torch.equal(t, rr):
                                    failures.append(f"{plan.mode} {kind} rank {r} {name} {dt} dim {dim}")
    ok = not failures
    print(f"[1] bit-exact Triton vs torch on {device}: {compared} kernel calls, {len(failures)} mismatches -> {'PASS' if ok else 'FAIL'}")
    for f in failures[:10]:
        print(f"    mismatch: {f}")
    return {"ok": ok, "kernel_calls": compared, "mismatches": failures[:50]}


def bandwidth_misses(rows: list[dict]) -> tuple[int, list[str]]:
    """(rows checked, misses) of kernel_bench rows against the targets: at TARGET_MIN_MB and
    more, Triton reaches TARGET_COPY_FRACTION of the copy bandwidth and beats the torch path."""
    checked, misses = 0, []
    for r in rows:
        if float(r["megabytes"]) < TARGET_MIN_MB:
            continue
        checked += 1
        tri, tor, copy = float(r["triton_gbps"]), float(r["torch_gbps"]), float(r["copy_gbps"])
        if tri < TARGET_COPY_FRACTION * copy or tri <= tor:
            misses.append(f"{r['tokens']} tokens P={r['group_size']} {r['op']}: triton {tri} GB/s, copy {copy}, torch {tor}")
    return checked, misses


def check_bandwidth(out: str) -> dict:
    """Run the kernel benchmark and check its rows of 64 MB and more against the targets."""
    rc, log = _run([sys.executable, "-m", "experiments.bench.kernels", "--out", out], 1800)
    print(log)
    if rc:
        return {"ok": False, "rows_checked": 0, "misses": [f"the benchmark failed (rc {rc})"], "csv": None}
    with open(os.path.join(out, "kernel_bench.csv")) as f:
        checked, misses = bandwidth_misses(list(csv.DictReader(f)))
    ok = checked > 0 and not misses
    print(f"[2] bandwidth targets on {checked} rows >= {TARGET_MIN_MB:.0f} MB: {len(misses)} misses -> {'PASS' if ok else 'FAIL'}")
    for m in misses:
        print(f"    miss: {m}")
    return {"ok": ok, "rows_checked": checked, "misses": misses, "csv": os.path.join(out, "kernel_bench.csv")}


def _run(cmd: list[str], timeout: int) -> tuple[int, str]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return p.returncode, (p.stdout + p.stderr)[-4000:]


def check_attention() -> dict:
    """flash-attn (when installed) and torch's own varlen kernel against the fp64 torch path."""
    out = {}
    for i, (name, absent) in enumerate((("flash", "flash-attn not installed"), ("varlen", "no torch.nn.attention.varlen"))):
        rc, log = _run([sys.executable, "-m", "pytest", "-q", "-rs", "tests/test_attention.py", "-k", f"cuda_backend and {name}"], 600)
        skipped = "skipped" in log and "passed" not in log
        state = f"skipped ({absent})" if skipped else ("PASS" if rc == 0 else "FAIL")
        print(f"[3{'ab'[i]}] {name} attention parity: {state}")
        out[name] = {"ok": rc == 0, "skipped": skipped, "log_tail": log[-1500:]}
    return out


def check_train(out: str) -> dict:
    # one rank holds the whole tiny step, so it needs a larger token budget than the default 32
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        "-m",
        "experiments.train",
        "--model",
        "tiny",
        "--steps",
        "3",
        "--tokens-per-rank",
        "512",
    ]
    cmd += ["--mode", "repack+solver", "--out", os.path.join(out, "train"), "--timeout", "120"]
    rc, log = _run(cmd, 600)
    print(f"[4] torchrun, 1 GPU, tiny model, 3 steps: {'PASS' if rc == 0 else 'FAIL'} (rc {rc})")
    if rc:
        print(log[-2000:])
    return {"ok": rc == 0, "log_tail": log[-1500:]}


@dataclass(frozen=True)
class GpuCheckOptions(Section):
    SECTION = "gpu_check"

    cpu_smoke: bool = setting(False, "no GPU: check 1 only, small, in Triton's interpreter")
    out: str = options.out("results/gpu_check")


COMMAND = Command("experiments.gpu_check", __doc__, (GpuCheckOptions,))


def main(argv=None) -> int:
    try:
        args = COMMAND.parse(argv).gpu_check
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("gpu_check needs a CUDA device (torch.cuda.is_available() is False); --cpu-smoke runs check 1 here")
        return 2
    os.makedirs(args.out, exist_ok=True)
    ctx = provenance()
    print(f"device: {ctx['device']}  commit {ctx['commit']}  torch {torch.__version__}")
    results = {"context": ctx, "bit_exact": check_bit_exact(torch.device("cuda" if cuda else "cpu"), quick=not cuda)}
    if cuda:
        results["bandwidth"] = check_bandwidth(args.out)
        results.update({f"attention.{k}": v for k, v in check_attention().items()})
        results["train"] = check_train(args.out)
    else:
        print("[2-4] skipped: no CUDA device (these are the GPU checks)")
    failed = [k for k, v in results.items() if k != "context" and not v["ok"]]
    path = os.path.join(args.out, "gpu_check.json")
    with open(path, "w") as f:
        json.dump({**results, "failed": failed}, f, indent=1)
    print(f"wrote {path}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
