"""The checks that need a CUDA GPU. `pytest -m gpu` on a GPU machine runs them with the kernels
compiled (tests/conftest.py leaves Triton's interpreter off for that run); `python3 -m
experiments.gpu_check` runs them and the kernel benchmark as one command. Without CUDA they are
collected and skipped.

- the Triton pack and unpack, compiled for the device, equal the torch reference bit for bit on
  NaN-poisoned buffers: every rank's entry and exit exchange of plans in every mode, fp32, bf16
  and fp16, head sizes 1, 63 and 128, Q, K and V with GQA;
- the registers and spills the device's loaded kernels report equal what kernels.machine_code
  reads from the same launches compiled on a CPU machine (so the CI's static checks hold on the
  device);
- the driver trains the tiny model on one GPU under torchrun (NCCL) in bf16 and in fp32, the
  losses within the tolerance the CPU runs keep (tests/test_train_e2e.py);
- the experts' grouped GEMM (torch._grouped_mm) within twice the error of the loop over experts
  in bf16, forward and backward;
- the Gated DeltaNet layer on flash-linear-attention's chunked kernel (fla-core) against the same
  layer on the CPU in float64 (model.linear's blockwise form), from incoming states, forward and
  backward; and the layer's own blockwise form on the device, where fla has no float64 or the
  attention backend is "torch".
"""

import importlib.util

import numpy as np
import pytest
import torch

from config import Cluster, HardwareConfig, ModelConfig
from solver import CostModel, head_to_token_plan, make_plan, samples_from_lengths, token_to_head_plan
from solver.modes import MODES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on one)")]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BF16_LOSS_RTOL = 5e-3  # the bf16 run's loss against the fp32 run's (tests/test_train_e2e.py keeps the same)


@pytest.fixture
def compiled():
    """Triton compiled for the device, not interpreted (a mixed run keeps the interpreter on)."""
    from kernels._triton import INTERPRETED

    if INTERPRETED:
        pytest.skip("Triton's interpreter is on in this run: run the GPU checks alone, pytest -m gpu")


def step_plan(mode: str, world: int = 32, gpus_per_node: int = 8, budget: int = 4096, seed: int = 0):
    """A step whose longest sample gets an SP16 parent across nodes (repacked into a node's
    children in the repack modes), planned in `mode` for a model of 32 heads."""
    cost = CostModel(ModelConfig.from_name("small"), HardwareConfig())
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in np.clip(rng.lognormal(np.log(budget / 4), 1.0, 8 * world), 1, budget // 2)]
    lengths = [world * budget // 6] + lengths
    while sum(lengths) > 0.7 * world * budget:
        lengths.pop()
    return make_plan(samples_from_lengths(lengths), Cluster(world, gpus_per_node, budget), cost, mode)


@pytest.mark.usefixtures("compiled", "poison_empty")
@pytest.mark.parametrize("mode", MODES)
def test_triton_pack_unpack_bit_exact_on_the_gpu(mode):
    from kernels.exchange import exchange_args
    from kernels.permute import gather_heads, scatter_heads

    dev = torch.device("cuda")
    plan = step_plan(mode)  # an SP16 parent, repacked in repack and repack+solver
    head_counts = [32, 8, 8]  # Q, K, V: the key/value heads replicated over SP16
    failures = []
    for kind, plans_of in (("entry", token_to_head_plan(plan.child_layout, plan.parent_layout)),
                           ("exit", head_to_token_plan(plan.parent_layout, plan.child_layout))):  # fmt: skip
        for r, ex in plans_of.items():
            a = exchange_args(ex, head_counts, dev)
            for dt, dtype in DTYPES.items():
                for dim in (1, 63, 128):
                    x = torch.randn(a.n_in, a.in_heads, dim, device=dev).to(dtype)
                    recv = torch.randn(int(sum(a.recv_counts)), a.pack_map.shape[1], dim, device=dev).to(dtype)
                    args = (a.unpack_rows, a.unpack_peers, a.unpack_map, a.n_out, a.out_heads)
                    pairs = (
                        ("pack", gather_heads(x, a.pack_rows, a.pack_peers, a.pack_map, "triton"),
                         gather_heads(x, a.pack_rows, a.pack_peers, a.pack_map, "torch")),
                        ("unpack", scatter_heads(recv, *args, "triton"), scatter_heads(recv, *args, "torch")),
                    )  # fmt: skip
                    for name, got, want in pairs:
                        if torch.isnan(got).any() or not torch.equal(got, want):
                            failures.append(f"{kind} rank {r} {name} {dt} dim {dim}")
    assert not failures, failures[:10]


@pytest.mark.usefixtures("compiled")
def test_the_devices_registers_equal_the_machine_code_read_on_a_cpu():
    from kernels.machine_code import _tensors as launch_tensors
    from kernels.machine_code import exchange_launches, inspect_launches
    from kernels.permute import launch_spec

    major, minor = torch.cuda.get_device_capability()
    arch = 10 * major + minor
    if arch not in (80, 90, 100):
        pytest.skip(f"sm_{arch}: the static checks cover sm_80, sm_90 and sm_100")
    specs = [s for dt in ("bf16", "fp32") for d in (128, 97) for s in exchange_launches([32, 8, 8], 16, d, dt, arch)[:4]]
    static = inspect_launches(specs)
    for spec, want in zip(specs, static):
        src, out, rows, peers, head_map = (t.cuda() for t in launch_tensors(spec))
        kernel, grid, args, meta = launch_spec(spec.op, src, out, rows, peers, head_map)
        loaded = kernel[grid](*args, **meta)
        loaded._init_handles()
        assert (loaded.n_regs, loaded.n_spills) == (want.registers, want.local_bytes), spec


def test_bf16_training_on_one_gpu_matches_fp32(tmp_path):
    import subprocess
    import sys

    from experiments.common.results import read_run
    from tests.dist_utils import ROOT

    losses = {}
    for dtype in ("fp32", "bf16"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "experiments.train", "--model", "tiny",
               "--steps", "3", "--tokens-per-rank", "512", "--mode", "repack+solver", "--dtype", dtype, "--timeout", "120",
               "--out", str(tmp_path / dtype)]  # fmt: skip
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
        cause = [line for line in p.stderr.splitlines() if "[rank" in line or "Error" in line]  # the rank's own error first
        assert p.returncode == 0, "\n".join(cause[:20]) + "\n...\n" + p.stderr[-1500:]
        rows, _ = read_run(str(tmp_path / dtype))
        losses[dtype] = [r["loss"] for r in sorted(rows, key=lambda r: r["step"])]
    np.testing.assert_allclose(losses["bf16"], losses["fp32"], rtol=BF16_LOSS_RTOL)


def test_grouped_gemm_error_at_most_twice_the_expert_loops():
    """The experts' grouped GEMM (torch._grouped_mm, bf16) against the loop over experts in bf16,
    both against fp32 (flash-attention's rule: at most twice the same-precision reference's error),
    forward and the weights' gradients; uneven counts, an expert with no row."""
    from model.experts import Experts

    torch.manual_seed(0)
    counts = [5, 0, 17, 3, 40, 1, 0, 9]
    experts = Experts(len(counts), 256, 512).cuda().to(torch.bfloat16)
    rows = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16)
    if not experts.grouped(rows):
        pytest.skip(f"torch {torch.__version__} has no grouped GEMM for these operands on this GPU")
    exact = Experts(len(counts), 256, 512).cuda()
    exact.load_state_dict({k: v.float() for k, v in experts.state_dict().items()})
    want = exact.reference(rows.float(), counts)
    want.sum().backward()
    errors = {}
    for name, run in (("grouped", experts.forward), ("loop", experts.reference)):
        experts.zero_grad()
        out = run(rows, counts)
        out.float().sum().backward()
        grad = max(float((p.grad.float() - q.grad).abs().max()) for p, q in zip(experts.parameters(), exact.parameters()))
        errors[name] = (float((out.float() - want).abs().max()), grad)
    assert errors["grouped"][0] <= 2 * errors["loop"][0] + 1e-3 and errors["grouped"][1] <= 2 * errors["loop"][1] + 1e-3, errors


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_the_gated_deltanet_layer_on_flas_kernel_matches_the_cpu_path(direction, monkeypatch):
    """fp32 on the device (fla's chunked Triton kernel) against float64 on the CPU: outputs and
    final states, and in `backward` every parameter's gradient, two samples from random incoming
    states. Where fla refuses its backward (model.linear.fla_refusal: Hopper under Triton 3.4 to
    3.7.0) the forward is still held to the CPU path and the backward is skipped, naming why."""
    pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is not installed")
    import model.linear as linear
    from model.linear import GatedDeltaNet

    refusal = linear.fla_refusal()
    if direction == "backward" and refusal is not None:
        pytest.skip(refusal)
    monkeypatch.setattr(linear, "fla_refusal", lambda: None)  # the forward runs fla's kernel even where its backward is refused
    torch.manual_seed(0)
    cpu = GatedDeltaNet(128, 2, 4, 64, 64, block=64).double()
    dev = GatedDeltaNet(128, 2, 4, 64, 64, block=64).cuda()
    dev.load_state_dict({k: v.float() for k, v in cpu.state_dict().items()})
    assert dev.fla_kernel(True, torch.float32, "auto") is not None, "the device layer must take fla's kernel"
    x = torch.randn(300, 128, dtype=torch.float64)
    states = torch.randn(2, 4, 64, 64, dtype=torch.float64) * 0.1
    cu = [0, 170, 300]
    results = []
    for layer, xx, st in ((cpu, x, states), (dev, x.float().cuda(), states.float().cuda())):
        with torch.set_grad_enabled(direction == "backward"):
            out, finals, _ = layer(xx, cu, st)
        grads = {}
        if direction == "backward":
            (out.square().sum() + finals.square().sum()).backward()
            grads = {n: p.grad.double().cpu() for n, p in layer.named_parameters()}
        results.append((out.double().cpu(), finals.double().cpu(), grads))
    (o_ref, s_ref, g_ref), (o, s, g) = results
    torch.testing.assert_close(o, o_ref, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(s, s_ref, rtol=2e-2, atol=2e-3)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=5e-2, atol=5e-3, msg=lambda m, n=name: f"gradient of {n}: {m}")


def test_the_gated_deltanet_layer_takes_the_torch_path_on_the_device_where_fla_cannot_or_is_told_not_to():
    """float64 on the device (fla's kernel has no float64) and fp32 under the "torch" backend run
    the project's blockwise form there: float64 equals the CPU's to rounding, and fp32 under
    "torch" agrees with fla's kernel (where fla-core is installed) as two fp32 paths do."""
    from model.linear import GatedDeltaNet, fla_refusal

    torch.manual_seed(0)
    cpu = GatedDeltaNet(64, 2, 4, 32, 32, block=32).double()
    dev = GatedDeltaNet(64, 2, 4, 32, 32, block=32).double().cuda()
    dev.load_state_dict(cpu.state_dict())
    x = torch.randn(90, 64, dtype=torch.float64)
    cu = [0, 50, 90]
    want = cpu(x, cu)[0]
    torch.testing.assert_close(dev(x.cuda(), cu)[0].cpu(), want, rtol=1e-10, atol=1e-12)
    dev.float()
    mine = dev(x.float().cuda(), cu, backend="torch")[0].double().cpu()
    torch.testing.assert_close(mine, want, rtol=1e-3, atol=1e-4)
    if importlib.util.find_spec("fla") is not None and fla_refusal() is None:
        torch.testing.assert_close(dev(x.float().cuda(), cu)[0].double().cpu(), mine, rtol=2e-2, atol=2e-3)
