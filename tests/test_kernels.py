"""Permute kernels (Triton interpreter) against the torch reference, exchanges in one process."""

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config import Cluster, HardwareConfig, ModelConfig
from kernels.exchange import exchange_all_ranks, exchange_args, head_split_map
from kernels.permute import gather_heads, scatter_heads
from solver import CostModel, Way, head_to_token_plan, make_plan, token_to_head_plan
from solver.modes import MODES
from tests.strategies import INTERPRETED_EXAMPLES, batches

COST = CostModel(ModelConfig.from_name("tiny"), HardwareConfig())
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def features(ids: np.ndarray, heads: int, dim: int, dtype) -> torch.Tensor:
    """Deterministic features of global token ids (every rank can build any rank's data)."""
    ids_t = torch.as_tensor(ids, dtype=torch.float64)
    sample, pos = torch.floor(ids_t / 2**32), torch.remainder(ids_t, 2**32)
    h = torch.arange(heads, dtype=torch.float64)[None, :, None]
    d = torch.arange(dim, dtype=torch.float64)[None, None, :]
    x = torch.sin(sample[:, None, None] * 1.7 + pos[:, None, None] * 0.013 + h * 0.37 + d * 0.011) * 3
    return x.to(dtype)


@st.composite
def small_plans(draw):
    g = draw(st.sampled_from([1, 2, 4]))
    nodes = draw(st.sampled_from([n for n in (1, 2, 4) if g * n <= 8]))  # up to 8 ranks: the interpreter is slow
    cluster = Cluster(g * nodes, g, draw(st.sampled_from([63, 97])))  # odd budgets; small grids for the interpreter
    return make_plan(draw(batches(cluster)), cluster, COST, draw(st.sampled_from(MODES)))


@pytest.mark.slow  # every rank's four launches of each drawn plan, interpreted: a quarter of the fast loop
@pytest.mark.usefixtures("poison_empty")
@settings(
    max_examples=INTERPRETED_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(plan=small_plans(), dtype=st.sampled_from(list(DTYPES)), dim=st.sampled_from([1, 8, 63]))
def test_triton_pack_unpack_bit_exact_with_reference(plan, dtype, dim):
    from solver import token_ids

    dt = DTYPES[dtype]
    world = plan.cluster.world_size
    # 16 query heads split over every group drawn here; 2 key/value heads, replicated in SP4/SP8
    head_counts = [16, 2, 2]
    entry = token_to_head_plan(plan.child_layout, plan.parent_layout)
    for r in range(world):
        a = exchange_args(entry[r], head_counts)
        x = features(token_ids(plan.child_layout, r), sum(head_counts), dim, dt)
        ref = gather_heads(x, a.pack_rows, a.pack_peers, a.pack_map, "torch")
        tri = gather_heads(x, a.pack_rows, a.pack_peers, a.pack_map, "triton")
        assert not torch.isnan(tri).any() and torch.equal(tri, ref)
        recv = torch.randn(sum(a.recv_counts), a.out_heads, dim).to(dt)
        ref = scatter_heads(recv, a.unpack_rows, a.unpack_peers, a.unpack_map, a.n_out, a.out_heads, "torch")
        tri = scatter_heads(recv, a.unpack_rows, a.unpack_peers, a.unpack_map, a.n_out, a.out_heads, "triton")
        assert not torch.isnan(tri).any() and torch.equal(tri, ref)
        inv = a.inverse()  # exit side: gather identity heads, scatter into head slices
        y = torch.randn(inv.n_in, inv.in_heads, dim).to(dt)
        sent = gather_heads(y, inv.pack_rows, inv.pack_peers, inv.pack_map, "triton")
        assert torch.equal(sent, gather_heads(y, inv.pack_rows, inv.pack_peers, inv.pack_map, "torch"))
        recv2 = torch.randn(sum(inv.recv_counts), inv.pack_map.shape[1], dim).to(dt)
        args2 = (inv.unpack_rows, inv.unpack_peers, inv.unpack_map, inv.n_out, inv.out_heads)  # replica slots, every one written
        back = scatter_heads(recv2, *args2, "triton")
        assert not torch.isnan(back).any() and torch.equal(back, scatter_heads(recv2, *args2, "torch"))


@pytest.mark.usefixtures("poison_empty")
@settings(
    max_examples=INTERPRETED_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(plan=small_plans(), backend=st.sampled_from(["torch", "triton"]))
def test_entry_then_exit_repacks_every_token_to_its_owner(plan, backend):
    from solver import head_token_ids, token_ids

    world, heads, dim = plan.cluster.world_size, 16, 5
    parent, child = plan.parent_layout, plan.child_layout
    entry = token_to_head_plan(child, parent)
    exit_ = head_to_token_plan(parent, child)
    ent = {r: exchange_args(entry[r], [heads]) for r in range(world)}
    ext = {r: exchange_args(exit_[r], [heads]) for r in range(world)}
    xs = {r: features(token_ids(child, r), heads, dim, torch.float32) for r in range(world)}
    hs = exchange_all_ranks(xs, ent, backend)
    by_rank = parent.group_of_rank()
    for r in range(world):
        g = by_rank[r]
        j = r - g.start
        want = features(head_token_ids(parent, g), heads, dim, torch.float32)[:, j * heads // g.size : (j + 1) * heads // g.size]
        assert torch.equal(hs[r], want)
    back = exchange_all_ranks(hs, ext, backend)
    for r in range(world):
        assert torch.equal(back[r], xs[r])


def test_qkv_travel_in_one_exchange_with_gqa_head_split():
    m = head_split_map([8, 2, 2], 2)
    assert m.tolist() == [[0, 1, 2, 3, 8, 10], [4, 5, 6, 7, 9, 11]]
    # wider than the key/value heads: each rank gets the one its query heads attend to
    assert head_split_map([8, 2, 2], 4).tolist() == [[0, 1, 8, 10], [2, 3, 8, 10], [4, 5, 9, 11], [6, 7, 9, 11]]
    with pytest.raises(ValueError, match="a part of 3 heads cannot be split over a group of 2 ranks"):
        head_split_map([8, 3, 3], 2)
    with pytest.raises(ValueError, match="a part of 2 heads cannot be split over a group of 4 ranks"):
        head_split_map([2], 4)  # query heads are never replicated


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gqa_entry_sends_each_rank_its_kv_head_and_the_way_back_sums_the_replicas(backend):
    from solver import Group, TokenLayout, head_token_ids, token_ids

    lengths = {0: 9, 1: 5, 2: 1}
    parent = TokenLayout((Group(0, 4, (0, 1, 2)),), lengths)
    child = TokenLayout((Group(0, 2, (0,)), Group(2, 1, (1,)), Group(3, 1, (2,))), lengths)
    head_counts, dim = [8, 2, 2], 3  # SP4 over 2 key/value heads: each replicated on 2 ranks
    entry = token_to_head_plan(child, parent)
    ent = {r: exchange_args(entry[r], head_counts) for r in range(4)}
    xs = {r: features(token_ids(child, r), 12, dim, torch.float64) for r in range(4)}
    heads = exchange_all_ranks(xs, ent, backend)
    whole = features(head_token_ids(parent, parent.groups[0]), 12, dim, torch.float64)
    for j in range(4):  # rank j: query heads 2j, 2j+1 and the key/value head j // 2 they attend to (8 // 2 per KV head)
        want = torch.cat([whole[:, 2 * j : 2 * j + 2], whole[:, 8 + j // 2 : 9 + j // 2], whole[:, 10 + j // 2 : 11 + j // 2]], dim=1)
        assert torch.equal(heads[j], want)
    back = exchange_all_ranks(heads, {r: a.inverse() for r, a in ent.items()}, backend)
    for r in range(4):  # the backward: each query head once, each key/value head from its 2 replicas
        assert torch.equal(back[r][:, :8], xs[r][:, :8]) and torch.equal(back[r][:, 8:], 2 * xs[r][:, 8:])


@pytest.mark.slow
def test_gpu_checks_are_collected_here_and_the_script_refuses_without_cuda(tmp_path, request):
    import subprocess
    import sys

    import experiments.gpu_check.__main__ as gpu_check
    from tests.dist_utils import ROOT

    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine the checks run: python3 -m experiments.gpu_check")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    # the script collects only the modules that hold GPU checks (a GPU image may lack the notebooks'
    # packages): they are the modules of every GPU test the whole suite collects. The yardstick is
    # pytest's own collection: this session's, where it collected every test module with nothing
    # deselected (the suite's run), else a `pytest --collect-only -m gpu` of the whole folder
    opt, tests = request.config.option, os.path.join(ROOT, "tests")
    modules = {f for f in os.listdir(tests) if f.startswith("test_") and f.endswith(".py")}
    seen = {os.path.basename(str(item.path)) for item in request.session.items}
    if modules <= seen and not (opt.keyword or opt.markexpr or opt.deselect):
        collected = [item.nodeid for item in request.session.items if item.get_closest_marker("gpu")]
    else:
        cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu", "tests"]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        collected = [line for line in p.stdout.splitlines() if "::" in line]
    script = {os.path.relpath(f, ROOT) for f in gpu_check.gpu_test_files(tests)}
    assert {c.split("::")[0] for c in collected} == script, (sorted(script), collected)
    assert any("test_gpu.py::test_triton_pack_unpack_bit_exact_on_the_gpu" in c for c in collected), collected
    assert any("test_attention.py::test_cuda_backend" in c for c in collected) and len(collected) >= 19  # 5 modes, 2, 12 backends


def test_gpu_check_bandwidth_targets():
    from experiments.gpu_check.__main__ import bandwidth_misses

    def row(mb, tri, tor, copy):
        return {"tokens": 1, "group_size": 8, "op": "pack", "megabytes": mb, "triton_gbps": tri, "torch_gbps": tor, "copy_gbps": copy}

    assert bandwidth_misses([row(32, 1, 2, 100), row(64, 80, 50, 100)]) == (1, [])  # small rows are not judged
    assert len(bandwidth_misses([row(128, 79, 50, 100)])[1]) == 1  # under 80% of copy
    assert len(bandwidth_misses([row(128, 90, 95, 100)])[1]) == 1  # slower than torch


def test_the_kernel_bench_counts_the_bytes_gqa_replication_sends():
    """At 2 key/value heads and P = 4 each peer gets 1 query head and one copy of a key and of a
    value head: 3 heads a row to each of 4 peers, 12 a row where the local tensor holds 8 (the
    bench's GB/s and its copy ceiling count those 12); at P = 2, 2 + 1 + 1 heads to 2 peers, 8."""
    from experiments.bench.kernels import _EntryPlan, moved_megabytes

    n, d = 1000, 8
    x = torch.randn(n, 8, d).to(torch.bfloat16)
    for p, heads_sent in ((4, 12), (2, 8)):
        a = exchange_args(_EntryPlan(n, p), [4, 2, 2], x.device)
        send = gather_heads(x, a.pack_rows, a.pack_peers, a.pack_map, "torch")
        assert moved_megabytes(send) == pytest.approx(n * heads_sent * d * 2 / 1e6)


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("hidden", [64, 97])
def test_triton_dispatch_permute_bit_exact_with_reference(hidden):
    """The experts' row gathers (model.experts): each token's top-k slots packed by expert, and the
    outputs back in slot order, forward and backward, through Triton (interpreted) and torch."""
    from model.experts import gather_slots, inverse_permutation, permute_rows

    g = torch.Generator().manual_seed(1)
    tokens, k = 37, 3
    experts = torch.randint(0, 8, (tokens * k,), generator=g)
    order = torch.argsort(experts, stable=True)
    inverse = inverse_permutation(order)
    out = {}
    for backend in ("torch", "triton"):
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2), dtype=torch.float64).requires_grad_()
        slots = gather_slots(x, order, inverse, k, backend)
        back = permute_rows(slots * 2, inverse, order, backend)
        back.backward(torch.cos(torch.arange(back.numel(), dtype=torch.float64)).view_as(back))
        out[backend] = (slots.detach(), back.detach(), x.grad)
    for got, want in zip(out["triton"], out["torch"]):
        assert not torch.isnan(got).any() and torch.equal(got, want)
    assert torch.equal(out["torch"][0], x.detach()[order // k])  # slot m holds token order[m] // k


@pytest.mark.usefixtures("poison_empty")
def test_triton_halo_packing_bit_exact_with_reference():
    """The halo exchange's packing (model.distributed.halo_rank_args: the rows each later rank
    reaches back to, then every chunk's keys gathered halo first) through Triton (interpreted) and
    torch, on every rank of halo children of two samples across nodes, window and chunked."""
    from kernels.permute import gather_rows
    from model.distributed import halo_rank_args
    from model.experts import permute_rows
    from solver import Group, TokenLayout
    from solver.cost import sparse_cost

    lengths = {0: 61, 1: 23, 2: 17}
    halo = Group(0, 5, (0, 1, 2), Way.HALO)
    layout = TokenLayout((halo, Group(5, 1, ())), lengths)
    g = torch.Generator().manual_seed(0)
    for kind, params in (("sliding_window", {"window": 9}), ("chunked", {"chunk": 8})):
        for rank in halo.ranks:
            args, rows, inverse, keys = halo_rank_args(layout, halo, rank, sparse_cost(kind).first_key, params)
            kv = torch.randn(args.n_in, 6, 7, generator=g, dtype=torch.float64)
            for _, r in args.sends:
                assert torch.equal(gather_rows(kv, r, "triton"), gather_rows(kv, r, "torch"))
            ext = torch.cat([torch.randn(args.n_recv, 6, 7, generator=g, dtype=torch.float64), kv])
            got, want = permute_rows(ext, rows, inverse, "triton"), permute_rows(ext, rows, inverse, "torch")
            assert not torch.isnan(got).any() and torch.equal(got, want) and torch.equal(want, ext[rows])
            assert int(keys.cu[-1]) == len(ext)  # every received and local row in one segment


def test_gpu_check_reports_each_pieces_tests_from_pytests_junit_xml(tmp_path):
    """gpu_check records, for each piece of the table of GPU runs, which of its tests passed,
    failed or were skipped: read from pytest's JUnit XML, a parametrized test's cases each under
    its piece (a hand-written report of each outcome)."""
    from experiments.common.gpu_pieces import PIECES
    from experiments.gpu_check.__main__ import piece_results

    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_gpu" name="test_triton_pack_unpack_bit_exact_on_the_gpu[baseline]"/>'
        '<testcase classname="tests.test_gpu" name="test_triton_pack_unpack_bit_exact_on_the_gpu[halo]"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_gpu" name="test_grouped_gemm_error_at_most_twice_the_expert_loops"><skipped/></testcase>'
        '<testcase classname="tests.test_other" name="test_unrelated"/>'
        "</testsuite></testsuites>"
    )
    r = piece_results(str(xml))
    assert set(r) == {n for n, p in PIECES.items() if p.tests}
    assert r["exchange kernels"] == {
        "passed": ["tests/test_gpu.py::test_triton_pack_unpack_bit_exact_on_the_gpu[baseline]"],
        "failed": ["tests/test_gpu.py::test_triton_pack_unpack_bit_exact_on_the_gpu[halo]"],
        "skipped": [],
    }
    assert r["experts"]["skipped"] == ["tests/test_gpu.py::test_grouped_gemm_error_at_most_twice_the_expert_loops"]
    assert not any("test_unrelated" in k for v in r.values() for ks in v.values() for k in ks)
