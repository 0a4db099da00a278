"""Exchanges over gloo: 8 spawned ranks, emulated nodes of 2, compared with the single-process permutation."""

import numpy as np
import pytest
import torch

from config import Cluster
from kernels.exchange import CommStats, ExchangeGroups, dist_transport, exchange, exchange_all_ranks, exchange_args
from solver import Group, ParentPlan, StepPlan, exchange_bytes, head_to_token_plan, token_ids, token_to_head_plan
from solver.sites import Family, sites_of
from tests.dist_utils import run_distributed
from tests.test_kernels import features

WORLD, NODE = 8, 2
# 16 query heads and 8 or 2 key/value heads (GQA): Q, K and V in one exchange; with 2 KV heads the
# SP8 parent replicates each over 4 ranks (and the backward sums the replicas' gradients)
QKV_CASES = ([16, 8, 8], [16, 2, 2])
D = 3


def repack_plan() -> StepPlan:
    """A parent of all 8 ranks (4 emulated nodes) repacked into children of 2 and 1 ranks."""
    lengths = ((0, 9), (1, 5), (2, 1), (3, 7), (4, 4), (5, 6), (6, 2))
    parent = Group(0, 8, tuple(s for s, _ in lengths))
    kids = (Group(0, 2, (0,)), Group(2, 1, (1, 2)), Group(3, 1, (3,)), Group(4, 2, (4, 5)), Group(6, 1, (6,)), Group(7, 1, ()))
    return StepPlan(Cluster(WORLD, NODE, 64), lengths, (ParentPlan(parent, kids, ""),), "repack").validate()


def _body(rank, world):
    for qkv in QKV_CASES:
        _check_exchanges(rank, world, qkv, torch.float64)
    _check_exchanges(rank, world, QKV_CASES[-1], torch.bfloat16)  # a GPU run's dtype: gloo moves bf16 too, bit for bit


def _check_exchanges(rank, world, QKV, dtype):
    plan = repack_plan()
    parent, child = plan.parent_layout, plan.child_layout
    entry_plans = token_to_head_plan(child, parent)
    exit_plans = head_to_token_plan(parent, child)
    groups = ExchangeGroups(world)
    groups.ensure(plan.group_shapes)
    transport = dist_transport(groups)
    entry = {r: exchange_args(entry_plans[r], QKV) for r in range(world)}
    exit_ = {r: exchange_args(exit_plans[r], QKV[:1]) for r in range(world)}
    xs = {r: features(token_ids(child, r), sum(QKV), D, dtype) for r in range(world)}
    weights = {
        r: torch.cos(torch.arange(xs[r].shape[0] * QKV[0] * D, dtype=torch.float64)).to(dtype).view(-1, QKV[0], D) for r in range(world)
    }
    # single-process reference: the same permutation on every rank at once, differentiated by torch
    ref_x = {r: xs[r].clone().requires_grad_() for r in range(world)}
    ref_heads = exchange_all_ranks(ref_x, entry, "torch")
    ref_out = exchange_all_ranks({r: ref_heads[r][:, : QKV[0] // 8].contiguous() for r in range(world)}, exit_, "torch")
    sum((ref_out[r] * weights[r]).sum() + ref_heads[r].sum() for r in range(world)).backward()

    for backend in ("torch", "triton"):
        stats = CommStats(gpus_per_node=NODE)
        x = xs[rank].clone().requires_grad_()
        heads = exchange(x, entry[rank], transport, backend, stats, "full.entry")
        assert torch.equal(heads, ref_heads[rank].detach())
        q_heads = heads[:, : QKV[0] // 8].contiguous()  # this rank's slice of the query heads
        out = exchange(q_heads, exit_[rank], transport, backend, stats, "full.exit")
        # entry then exit with the repacking layout returns every token to the rank the child layout names
        assert torch.equal(out, xs[rank][:, : QKV[0]])
        # the backward runs our _Exchange.backward (the inverse exchanges, over gloo); the yardstick
        # is torch's autograd of the single-process permutation
        ((out * weights[rank]).sum() + heads.sum()).backward()
        ref_grad = ref_x[rank].grad if ref_x[rank].grad is not None else torch.zeros_like(x)  # a rank with no tokens
        torch.testing.assert_close(x.grad, ref_grad, rtol=0, atol=0)
        assert stats.calls["full.entry"] == 1 and stats.calls["full.exit"] == 1
        assert stats.calls["full.entry.bwd"] == 1 and stats.calls["full.exit.bwd"] == 1
        row_bytes = entry[rank].out_heads * D * x.element_size()  # this rank's heads of each peer's slice, replicas included
        expect = exchange_bytes(entry_plans, world, row_bytes)[rank]
        for dst in range(world):
            if dst != rank:
                assert stats.bytes_to_peer["full.entry"].get((rank, dst), 0) == expect[dst], (rank, dst)
        crossing = sum(int(expect[d]) for d in range(world) if d // NODE != rank // NODE)
        assert stats.bytes_by_site["full.entry"][1] == crossing
        assert crossing > 0 or xs[rank].shape[0] == 0  # the parent spans nodes: entry bytes cross them
        # the sparse layers' own exchange stays inside the child: no byte crosses a node
        sp = token_to_head_plan(child, child)[rank]
        y = exchange(xs[rank], exchange_args(sp, QKV), transport, backend, stats, "sparse.entry")
        assert y.shape[0] == sum(child.lengths[s] for s in child.group_of_rank()[rank].samples)
        assert stats.inter_node_bytes(sites_of(Family.SPARSE)) == 0


@pytest.mark.slow
def test_exchange_over_gloo_matches_single_process_permutation():
    run_distributed(_body, WORLD)


def test_plan_is_what_the_test_claims():
    plan = repack_plan()
    assert plan.parents[0].repacked and plan.parents[0].group.size == 8
    assert all(c.size <= NODE for c in plan.parents[0].children)
    assert np.sum(exchange_bytes(token_to_head_plan(plan.child_layout, plan.parent_layout), WORLD, 1)) > 0
