"""The pack kernels compiled for the GPUs they are for, on a machine without one (Triton's bundled
ptxas and cuobjdump), and held to what their SASS must show.

For the launches of the presets' exchanges on sm_90 (the H200's) in bf16, fp16 and fp32, for head
sizes 128, 64, the presets' 32 and 8, and an odd 97; on sm_80 and sm_100 the same launches in bf16
and fp32 for an aligned (128) and the odd head size (every arch, dtype and head size under
REPACK_EXPLORE=1); and the experts' row gathers of the presets' hidden sizes on every arch
(launch_matrix says which):
- nothing spills to local memory;
- where a head's row is 16-byte aligned, every data access is a 128-bit LDG.E.128 / STG.E.128,
  and a thread has all its data loads in flight before its first store;
- registers stay within the budget that keeps enough bytes in flight per SM for the device's
  bandwidth over its memory latency (Little's law), with a margin: resident warps (from the
  registers) x 32 threads x the bytes a thread has in flight >= MARGIN x bandwidth x latency / SMs,
  for the most demanding device of each compute capability (A100, H200, B200);
- where it is not aligned (97), every data access is one element wide (a wider access of a
  misaligned row would fault), and test_kernels runs that case bit-exact through the interpreter.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from config import GPU_DEVICES, MEMORY_LATENCY_S, ModelConfig
from kernels.machine_code import (
    ARCHS,
    DTYPES,
    ELEMENT_BYTES,
    SM_LIMITS,
    LaunchSpec,
    bytes_in_flight_needed,
    exchange_launches,
    inspect_launches,
    register_budget,
    resident_warps,
)
from kernels.permute import gather_heads, scatter_heads
from tests.strategies import EXPLORE

DEVICE_OF_ARCH = {80: "a100", 90: "h200", 100: "b200"}  # the most bandwidth per SM of each compute capability
MARGIN = 1.5
ODD_HEAD_DIM = 97


def _heads(name: str) -> list[int]:
    m = ModelConfig.from_name(name)
    return [m.n_heads, m.n_kv_heads, m.n_kv_heads]


def launch_matrix():
    """sm_90: every dtype x head size (128, 64, 97) for the forward launches of the paper's SP16
    exchanges, and the other presets' heads at their own head sizes (32, 8) in bf16; sm_80 and
    sm_100 (whose code differs from sm_90's by the target, not by the tile): the paper's launches in
    bf16 and fp32 at head sizes 128 and 97, the aligned and the odd row; sm_90 bf16: every group
    size of the paper's exchanges, forward and backward. REPACK_EXPLORE=1: every launch of every
    preset's group sizes in every arch, dtype and head size."""
    specs = []
    for arch in ARCHS:
        every = arch == 90 or EXPLORE
        for dtype in DTYPES if every else ("bf16", "fp32"):
            for head_dim in (128, 64, ODD_HEAD_DIM) if every else (128, ODD_HEAD_DIM):
                specs += exchange_launches(_heads("paper"), 16, head_dim, dtype, arch)[: 4 if not EXPLORE else None]
        for name, p in (("small", 16), ("tiny", 8), ("tiny-gqa", 8)) if every else ():
            specs += exchange_launches(_heads(name), p, ModelConfig.from_name(name).head_dim, "bf16", arch)
    for p in (2, 4, 8, 32):
        specs += exchange_launches(_heads("paper"), p, 128, "bf16", 90)
    for arch in ARCHS:  # the experts' dispatch and combine: rows of the hidden state, one "head" of hidden size
        specs += [LaunchSpec("gather", dtype, 4096, 1, 1, arch) for dtype in DTYPES]
        specs += [LaunchSpec("gather", "bf16", ModelConfig.from_name(name).hidden, 1, 1, arch) for name in ("small", "tiny")]
    if EXPLORE:
        for arch in ARCHS:
            for dtype in DTYPES:
                for name in ("paper", "small", "tiny", "tiny-gqa"):
                    for p in (2, 4, 8, 16, 32)[: 3 if name.startswith("tiny") else None]:
                        for head_dim in {ModelConfig.from_name(name).head_dim, 128, 64, ODD_HEAD_DIM}:
                            specs += exchange_launches(_heads(name), p, head_dim, dtype, arch)
    return list(dict.fromkeys(specs))


@pytest.fixture(scope="module")
def reports():
    return inspect_launches(launch_matrix())


def _name(r) -> str:
    s = r.spec
    return f"sm_{s.arch} {s.op} {s.dtype} D{s.head_dim} heads {s.heads}/{s.token_heads}"


@pytest.mark.slow
def test_every_launch_compiles_for_sm80_sm90_sm100_without_spills(reports):
    assert {r.spec.arch for r in reports} == set(ARCHS) and len(reports) == len(launch_matrix())
    spilled = [f"{_name(r)}: {r.local_bytes} local bytes" for r in reports if r.local_bytes]
    assert not spilled, spilled
    untraced = [_name(r) for r in reports if r.accesses.untraced_stores or not r.accesses.stores]
    assert not untraced, f"stores whose data no load provides: {untraced}"


@pytest.mark.slow
def test_aligned_data_path_is_128_bit_with_every_load_in_flight_before_the_first_store(reports):
    aligned = [r for r in reports if r.aligned]
    assert len(aligned) > len(reports) // 2
    for r in aligned:
        stores, loads = r.accesses.stores, r.accesses.data_loads
        assert set(stores) == {128} and loads == stores, f"{_name(r)}: data loads {loads}, stores {stores}"
        bm, bh, bd = r.tile
        per_thread = bm * bh * bd * ELEMENT_BYTES[r.spec.dtype] // (32 * r.num_warps)  # head sizes here are powers of two
        assert r.accesses.bytes_before_first_store == per_thread, _name(r)


@pytest.mark.slow
def test_registers_keep_enough_bytes_in_flight_for_each_devices_bandwidth(reports):
    over = []
    for r in (r for r in reports if r.aligned):
        dev = GPU_DEVICES[DEVICE_OF_ARCH[r.spec.arch]]
        need = MARGIN * bytes_in_flight_needed(dev.hbm_bw, MEMORY_LATENCY_S, dev.sms)
        budget = register_budget(need, r.accesses.bytes_before_first_store, r.num_warps, SM_LIMITS[r.spec.arch])
        if not (r.registers <= budget and r.bytes_in_flight_per_sm >= need):
            over.append(
                f"{_name(r)}: {r.registers} registers (budget {budget}), {r.bytes_in_flight_per_sm} B in flight per SM, need {need:.0f}"
            )
    assert not over, over


@pytest.mark.slow
def test_odd_head_size_moves_one_element_per_access(reports):
    odd = [r for r in reports if r.spec.head_dim == ODD_HEAD_DIM]
    assert odd and not any(r.aligned for r in odd)
    for r in odd:
        bits = 8 * ELEMENT_BYTES[r.spec.dtype]
        assert set(r.accesses.stores) == {bits} and set(r.accesses.data_loads) == {bits}, _name(r)


# compiled with the interpreter off, in a process of its own: two kernels for sm_90 (read in one
# disassembly, so the cut between them is tested) and one for sm_80
_BOTH_READINGS = """
import json
from kernels.machine_code import LaunchSpec, _compile, read_cubin, read_cubins
specs = [LaunchSpec("gather", "bf16", 128, 4, 48, 90), LaunchSpec("scatter", "fp32", 97, 4, 4, 90),
         LaunchSpec("gather", "bf16", 128, 4, 48, 80)]
cubins = [_compile(s)[2:] for s in specs]
print(json.dumps({"one_call": read_cubins(cubins), "alone": [read_cubin(c) for c, _ in cubins],
                  "targets": [t for _, t in cubins]}))
"""


def _instructions(sass: str) -> list[str]:
    """The instruction lines of a disassembly, without cuobjdump's encodings, spaces squeezed."""
    lines = [re.sub(r"/\* 0x[0-9a-f]+ \*/", "", line) for line in sass.splitlines()]
    return [" ".join(line.split()) for line in lines if re.match(r"\s*/\*[0-9a-f]+\*/", line)]


@pytest.mark.slow
def test_one_disassembly_per_target_reads_each_kernel_as_cuobjdump_reads_it_alone():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": root}
    run = subprocess.run([sys.executable, "-c", _BOTH_READINGS], capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout)
    assert got["targets"] == ["sm_90a", "sm_90a", "sm_80"]
    for (regs, local, sass), (regs_alone, local_alone, sass_alone) in zip(got["one_call"], got["alone"], strict=True):
        assert (regs, local) == (regs_alone, local_alone)
        assert len(_instructions(sass_alone)) > 20 and _instructions(sass) == _instructions(sass_alone)
    assert _instructions(got["one_call"][0][2]) != _instructions(got["one_call"][1][2])


def test_residency_follows_the_occupancy_arithmetic():
    # registers per warp round up to 256; 4-warp blocks; at most 64 warps and 32 blocks an SM
    assert resident_warps(32, 4) == 64  # 16 blocks: warp-limited
    assert resident_warps(40, 4) == 48  # 1280 registers a warp: 12 blocks
    assert resident_warps(57, 4) == 32  # 57 x 32 = 1824 -> 2048 a warp: 8 blocks
    assert resident_warps(255, 4) == 8  # 8192 a warp: 2 blocks
    assert resident_warps(32, 1) == 32  # block-limited
    # B200: 8 TB/s x 0.7 us over 148 SMs, 1.5x: a thread with 64 bytes in flight needs 28 warps
    need = 1.5 * bytes_in_flight_needed(8e12, 0.7e-6, 148)
    assert register_budget(need, 64, 4) == 72 and resident_warps(72, 4) * 32 * 64 >= need > resident_warps(80, 4) * 32 * 64


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_odd_head_size_is_bit_exact_interpreted(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 48, ODD_HEAD_DIM, generator=g).to(dtype)
    rows = torch.randint(0, 37, (53,), generator=g)
    peers = torch.randint(0, 16, (53,), generator=g).to(torch.int32)
    head_map = torch.randint(0, 48, (16, 4), generator=g).to(torch.int32)
    packed = gather_heads(x, rows, peers, head_map, "triton")
    assert torch.equal(packed, gather_heads(x, rows, peers, head_map, "torch"))
    perm = torch.randperm(53, generator=g)
    ident = torch.arange(4, dtype=torch.int32).expand(16, 4).contiguous()
    back = scatter_heads(packed, perm, peers, ident, 53, 4, "triton")
    assert not torch.isnan(back).any() and torch.equal(back, scatter_heads(packed, perm, peers, ident, 53, 4, "torch"))
