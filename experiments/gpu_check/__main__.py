"""The checks that need a GPU, as one prepared run (a few minutes on one H100/H200).

    python3 -m experiments.gpu_check --out results/gpu_check     # on a CUDA machine

1. `pytest -m gpu` (tests/test_gpu.py, tests/test_attention.py's CUDA backends), Triton compiled
   for the device: the pack and unpack bit-exact against the torch reference on NaN-poisoned
   buffers in every mode, dtype and head size; the device's registers and spills equal the
   machine code read on a CPU (kernels.machine_code); flash-attn (when installed) and torch's
   varlen attention within twice the torch path's bf16 error; the tiny model trained on one GPU
   under torchrun (NCCL) in bf16 and fp32, the losses within the tolerance the CPU runs keep.
2. The kernel benchmark (experiments.bench.kernels) with its targets checked: at 64 MB and more,
   Triton at least 80% of the device-copy bandwidth and faster than the torch path; its table
   of static bounds says what the machine code allows on this GPU.

Writes <out>/gpu_check.json (figures, device, commit, and for each piece of the table of GPU
runs, experiments/common/gpu_pieces.py, which of its tests passed, failed or were skipped here:
what to copy into that table after a run on a new device) and exits 1 if any check fails; without
CUDA it says so and exits 2 (the GPU tests are collected and skipped in every CPU run).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import torch

from config.cli import Command
from config.entries import GpuCheckOptions
from experiments.common import entry
from experiments.common.gpu_pieces import PIECES
from experiments.common.provenance import provenance

TARGET_COPY_FRACTION = 0.8
TARGET_MIN_MB = 64.0


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


def gpu_test_files(folder: str = "tests") -> list[str]:
    """The test modules that hold GPU tests (they carry the gpu marker). Only these are collected,
    so a GPU image without the notebooks' packages (nbformat, nbclient) still runs the checks."""
    names = sorted(f for f in os.listdir(folder) if f.startswith("test_") and f.endswith(".py"))
    out = []
    for name in names:
        with open(os.path.join(folder, name)) as f:
            if "pytest.mark.gpu" in f.read():
                out.append(os.path.join(folder, name))
    return out


def piece_results(junit_xml: str) -> dict[str, dict[str, list[str]]]:
    """For each piece of the table of GPU runs that names GPU tests: its tests' cases (a
    parametrized test's each) that passed, failed or were skipped, from pytest's JUnit XML."""
    outcome: dict[str, str] = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        name = case.get("name", "")
        kinds = {child.tag for child in case}
        outcome[f"{path}::{name}"] = "failed" if kinds & {"failure", "error"} else ("skipped" if "skipped" in kinds else "passed")
    out = {}
    for piece, p in PIECES.items():
        if not p.tests:
            continue
        mine = {k: v for k, v in outcome.items() if k.split("[")[0] in p.tests}
        out[piece] = {state: sorted(k for k, v in mine.items() if v == state) for state in ("passed", "failed", "skipped")}
    return out


def check_gpu_tests(out: str) -> dict:
    """pytest -m gpu over the modules that hold GPU tests, alone in its process (Triton compiled
    for the device, not interpreted), with each piece's tests' outcomes (piece_results)."""
    xml = os.path.join(out, "gpu_tests.xml")
    rc, log = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-m", "gpu", f"--junitxml={xml}", *gpu_test_files()], 1800)
    summary = log.strip().splitlines()[-1] if log.strip() else ""
    print(f"[1] pytest -m gpu: {summary} -> {'PASS' if rc == 0 else 'FAIL'}")
    if rc:
        print(log[-3000:])
    pieces = piece_results(xml) if os.path.exists(xml) else {}
    for piece, r in pieces.items():
        print(f"    {piece}: {len(r['passed'])} passed, {len(r['failed'])} failed, {len(r['skipped'])} skipped")
    if pieces:
        print("    (a new device: record each piece's result in experiments/common/gpu_pieces.py)")
    return {"ok": rc == 0, "summary": summary, "log_tail": log[-3000:], "pieces": pieces}


COMMAND = Command("experiments.gpu_check", __doc__, (GpuCheckOptions,))


def main(argv=None) -> int:
    args = entry.parse(COMMAND, argv).gpu_check
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA device (torch.cuda.is_available() is False); its tests run in every CPU run, skipped")
        return 2
    os.makedirs(args.out, exist_ok=True)
    ctx = provenance()
    print(f"device: {ctx['device']}  commit {ctx['commit']} (files: tree {ctx['tree'][:12] or 'unknown'})  torch {torch.__version__}")
    results = {"context": ctx, "gpu_tests": check_gpu_tests(args.out), "bandwidth": check_bandwidth(args.out)}
    failed = [k for k, v in results.items() if k != "context" and not v["ok"]]
    path = os.path.join(args.out, "gpu_check.json")
    with open(path, "w") as f:
        json.dump({**results, "failed": failed}, f, indent=1)
    print(f"wrote {path}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
