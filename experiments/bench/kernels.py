"""Bandwidth of the pack/unpack kernels around the all-to-all.

    python -m experiments.bench.kernels            # on CUDA: Triton vs torch vs a device copy
    python -m experiments.bench.kernels --quick    # small sizes (the CPU run uses these)

For each local token count, P and direction it times the pack (entry: head split into per-peer
blocks) and the unpack (entry: rows placed in the group's sample order, a permutation), and
reports GB/s counting one read and one write of every element of the send buffer (each key/value
head as often as GQA replication sends it), against torch.clone of the same bytes (the copy
ceiling) and against the torch reference path, for the model's query and key/value heads
(--model, or --n-heads, --n-kv-heads, --head-dim). On CPU only the torch path runs and the
figures are NOT GPU figures. Writes <out>/kernel_bench.csv.

First, on any machine, it prints what the kernels' machine code says about each GPU (A100, H100,
H200, B200): the same launches compiled for the device's sm_XX (kernels.machine_code), their
registers, vector width, resident warps and bytes in flight per SM against what Little's law asks
for the device's bandwidth, and the bound that puts on the GB/s a first GPU run can show
(<out>/kernel_static.csv).
"""

from __future__ import annotations

import csv
import os
import time

import numpy as np
import torch

from config import GPU_DEVICES, MEMORY_LATENCY_S, ModelConfig
from config.cli import Command
from config.entries import KernelBenchOptions
from experiments.common import entry
from experiments.common.files import check_output_dir
from experiments.common.provenance import provenance
from kernels.exchange import exchange_args
from kernels.machine_code import ELEMENT_BYTES, bytes_in_flight_needed, exchange_launches, inspect_launches
from kernels.permute import gather_heads, scatter_heads


class _EntryPlan:
    """Rank 0's entry exchange of a group of P ranks each holding n tokens (rows land permuted)."""

    def __init__(self, n: int, p: int, seed: int = 0):
        self.to_heads, self.group_start, self.group_size, self.rank = True, 0, p, 0
        self.n_in, self.n_out = n, n * p
        self.send_counts = np.full(p, n)
        self.recv_counts = np.full(p, n)
        self.pack_rows = np.tile(np.arange(n), p)
        self.unpack_rows = np.random.default_rng(seed).permutation(n * p)


def _time(fn, cuda: bool) -> float:
    """Median seconds of fn()."""
    if cuda:
        from triton.testing import do_bench

        return do_bench(fn, quantiles=[0.5, 0.2, 0.8])[0] * 1e-3
    fn()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _ops(x, a, send):
    """(name, path -> callable) of the entry pack and unpack for one size."""

    def pack(path):
        return lambda: gather_heads(x, a.pack_rows, a.pack_peers, a.pack_map, path)

    def unpack(path):
        return lambda: scatter_heads(send, a.unpack_rows, a.unpack_peers, a.unpack_map, a.n_out, a.out_heads, path)

    return (("pack", pack), ("unpack", unpack))


COMMAND = Command(
    "experiments.bench.kernels", __doc__, (ModelConfig, KernelBenchOptions), only={"model": ("n_heads", "n_kv_heads", "head_dim")}
)


def moved_megabytes(send: torch.Tensor) -> float:
    """Megabytes each of the pack's and the unpack's sides moves: the send buffer's. It exceeds the
    local tensor's where a group holds more ranks than key/value heads, since each such head then
    goes to several peers (GQA replication: at 8 KV heads and P = 32, 4 copies each), so the pack
    reads it and writes it that many times, and the unpack receives that many."""
    return send.numel() * send.element_size() / 1e6


def index_bytes_per_element(heads: int, head_dim: int) -> float:
    """Index bytes a pack kernel reads per element it moves: a row (int64) and its peer (int32) per
    row, a head-map entry (int32) per row and head."""
    return (8 + 4 + 4 * heads) / (heads * head_dim)


def static_bounds(head_counts: list[int], head_dim: int, groups: list[int], dtype: str = "bf16") -> list[dict]:
    """Per device and entry exchange of each group size: the pack (gather) and unpack (scatter)
    launches compiled for the device, and the bound their machine code puts on bandwidth: the
    share of the device's HBM bandwidth the bytes in flight per SM cover (Little's law, at
    MEMORY_LATENCY_S), capped at 1."""
    devices = list(GPU_DEVICES.items())
    specs = [
        (name, p, s) for name, dev in devices for p in groups for s in exchange_launches(head_counts, p, head_dim, dtype, dev.arch)[:2]
    ]
    reports = inspect_launches([s for _, _, s in specs])
    rows = []
    for (name, p, spec), r in zip(specs, reports):
        dev = GPU_DEVICES[name]
        need = bytes_in_flight_needed(dev.hbm_bw, MEMORY_LATENCY_S, dev.sms)
        share = min(1.0, r.bytes_in_flight_per_sm / need)
        eb = ELEMENT_BYTES[dtype]
        rows.append(
            {
                "gpu": dev.name,
                "arch": f"sm_{dev.arch}",
                "group_size": p,
                "op": "pack" if spec.op == "gather" else "unpack",
                "dtype": dtype,
                "heads": spec.heads,
                "head_dim": head_dim,
                "registers": r.registers,
                "spill_bytes": r.local_bytes,
                "vector_bytes": r.vector_elements * eb,
                "bytes_in_flight_per_thread": r.accesses.bytes_before_first_store,
                "resident_warps": r.resident_warps,
                "in_flight_kb_per_sm": round(r.bytes_in_flight_per_sm / 1024, 1),
                "needed_kb_per_sm": round(need / 1024, 1),
                "bytes_per_element": round(2 * eb + index_bytes_per_element(spec.heads, head_dim), 3),
                "bound_gbps": round(share * dev.hbm_bw / 1e9),
                "hbm_gbps": round(dev.hbm_bw / 1e9),
            }
        )
    return rows


STATIC_COLUMNS = (  # (header, width, key, format) of the printed machine-code table
    ("gpu", 14, "gpu", "s"),
    ("P", 3, "group_size", "d"),
    ("op", 7, "op", "s"),
    ("regs", 5, "registers", "d"),
    ("vec B", 5, "vector_bytes", "d"),
    ("warps", 5, "resident_warps", "d"),
    ("KB/SM", 6, "in_flight_kb_per_sm", ".1f"),
    ("need", 6, "needed_kb_per_sm", ".1f"),
    ("B/elem", 7, "bytes_per_element", ".3f"),
    ("bound GB/s", 11, "bound_gbps", "d"),
    ("HBM", 6, "hbm_gbps", "d"),
)


def print_static(rows: list[dict]) -> None:
    print(f"machine code per device (compiled here for each sm_XX; latency {MEMORY_LATENCY_S * 1e6:.1f} us assumed):")
    print(" ".join(f"{h:>{w}}" for h, w, _, _ in STATIC_COLUMNS))
    for r in rows:
        print(" ".join(f"{r[k]:>{w}{f}}" for _, w, k, f in STATIC_COLUMNS))


def write_csv(path: str, rows: list[dict]) -> None:
    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")


def main(argv=None):
    s = entry.parse(COMMAND, argv)
    args, m = s.bench, s.model
    with entry.user_errors():
        check_output_dir(args.out)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    tokens = [2048, 8192] if (args.quick or not cuda) else [16384, 65536, 131072]
    groups = [8, 16, 32]
    paths = ["triton", "torch"] if cuda else ["torch"]
    ctx = provenance()
    head_counts = [m.n_heads, m.n_kv_heads, m.n_kv_heads]
    print(f"device: {ctx['device']}  commit {ctx['commit']}  dtype bf16  heads {head_counts} x {m.head_dim}")
    static = [{**r, **ctx} for r in static_bounds(head_counts, m.head_dim, groups)]
    print_static(static)
    write_csv(os.path.join(args.out, "kernel_static.csv"), static)
    if not cuda:
        print("NOTE: no CUDA device: torch path on CPU only. These are NOT GPU figures; run on a GPU for the kernel targets.")
    rows = []
    print(f"{'tokens':>7} {'P':>3} {'op':>7} {'MB':>8} {'copy GB/s':>10} " + " ".join(f"{p + ' GB/s':>12} {'/copy':>6}" for p in paths))
    for n in tokens:
        x = torch.randn(n, sum(head_counts), m.head_dim, device=dev).to(dtype)
        for p in groups:
            a = exchange_args(_EntryPlan(n, p), head_counts, dev)
            send = gather_heads(x, a.pack_rows, a.pack_peers, a.pack_map, "torch")
            mb = moved_megabytes(send)
            t_copy = _time(send.clone, cuda)
            copy_bw = 2 * mb / 1e3 / t_copy
            for op, fn_of in _ops(x, a, send):
                cells, row = [], {"tokens": n, "group_size": p, "op": op, "megabytes": round(mb, 1), "copy_gbps": round(copy_bw, 1)}
                for path in paths:
                    t = _time(fn_of(path), cuda)
                    bw = 2 * mb / 1e3 / t
                    row[f"{path}_gbps"] = round(bw, 1)
                    row[f"{path}_ms"] = round(t * 1e3, 4)
                    cells.append(f"{bw:12.1f} {bw / copy_bw:6.2f}")
                rows.append({**row, **ctx})
                print(f"{n:7d} {p:3d} {op:>7} {mb:8.1f} {copy_bw:10.1f} " + " ".join(cells), flush=True)
    write_csv(os.path.join(args.out, "kernel_bench.csv"), rows)


if __name__ == "__main__":
    main()
