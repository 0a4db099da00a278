"""Expert parallelism over gloo: 8 forked ranks in nodes of 2, EP 2 (inside a node) and EP 4
(across two), FSDP2 (the experts sharded over their replicas): with MHA at EP2, a mode of every
layout the experts can see a rank's tokens in (the parent's, Ulysses children, halo children, the
parent's with halos, children reached by a redistribution, the per-parent mix: the solvers' stages
only move samples between groups of these layouts, which tests/test_model_distributed.py runs in
every mode), repack+solver and choose at EP4 and with GQA; replicated parameters (the experts' gradients
summed over their replicas): repack+solver with MHA.

- the loss and every gradient equal the single-process run's (fp64), each rank's expert slice
  against the same slice of the whole model's gradient;
- the experts' all-to-alls' counted bytes equal, exactly, the bytes the routing the ranks made
  implies (recorded at the dispatch: the experts of every slot, forward);
- and the simulator's expectation under uniform routing (each slot leaves its rank with
  probability (N - 1) / N) within four binomial standard deviations of the slots: the spread of
  that routing (the routing of a token's top-k distinct experts spreads less);
- FSDP2's parameter gathers and gradient reductions (the experts' over their replicas) send the
  bytes, in the calls, that the simulator prices.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from config import CostsConfig, HardwareConfig
from kernels.exchange import CommStats, ExchangeGroups
from model.distributed import run_step
from model.experts import ExpertDispatch
from model.sharding import full_tensor, replicate_experts, shard_model
from solver import CostModel
from solver.modes import MODE_TABLE
from solver.simulator import simulate
from solver.sites import Site, sites_of
from tests.dist_utils import ShardCollectives, run_distributed
from tests.test_model_distributed import (
    CONFIGS,
    LENGTHS,
    NODE,
    WORLD,
    assert_sync_priced,
    distinct_layouts,
    make_model,
    reference,
    sample_tokens,
    solver_plans,
)

EPS = (2, 4)
# the first mode of each layout a rank's tokens can be in when the experts see them
LAYOUTS = {(m.start, m.folded, m.cheapest): m.name for m in reversed(MODE_TABLE)}


def _body(rank, world, refs):
    groups = ExchangeGroups(world)
    recorded = []  # the sorted experts of every dispatch this rank runs, forward
    run = ExpertDispatch.__call__

    def recording(self, x, order, sorted_experts, k, experts):
        recorded.append(sorted_experts.clone())
        return run(self, x, order, sorted_experts, k, experts)

    ExpertDispatch.__call__ = recording
    spreads = []
    for name, cfg in CONFIGS.items():
        ref_loss, ref_grads = refs[name]
        for ep in EPS:
            per = cfg.n_experts // ep
            mine = slice((rank % ep) * per, (rank % ep + 1) * per)
            # a mode of every layout for MHA inside a node (EP2); across nodes (EP4), and for GQA,
            # the paper's best and the per-parent choice (the dispatch is the same code at every
            # degree: the degree changes where the slots go, which the byte checks below hold)
            wanted = set(LAYOUTS.values()) if name == "mha" and ep == 2 else {"repack+solver", "choose"}
            for plan in distinct_layouts(p for p in solver_plans(cfg) if p.label in wanted):
                model = shard_model(make_model(cfg).expert_parallel(ep, rank), torch.device("cpu"))
                stats = CommStats(gpus_per_node=NODE)
                recorded.clear()
                with ShardCollectives() as sync:
                    loss = run_step(model, plan, sample_tokens(LENGTHS), groups, "torch", "torch", stats)
                where = f"{name} EP{ep} {plan.label}"
                assert_sync_priced(sync, cfg, world, ep, where)
                torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12, msg=where)
                for n, p in model.named_parameters():
                    want = ref_grads[n][mine] if ".experts." in n else ref_grads[n]
                    torch.testing.assert_close(full_tensor(p.grad), want, rtol=1e-9, atol=1e-11, msg=f"{where} {n}")
                # the routing's bytes: forward, the dispatch sends each slot off the rank and the
                # combine sends back what came in; backward, the reverse of each (no recompute here)
                row = cfg.hidden * 8
                sent = [0, 0]  # intra, inter
                back = torch.zeros(world, dtype=torch.float64)  # slots this rank received, by source
                for experts in recorded:
                    dest = rank - rank % ep + torch.div(experts, per, rounding_mode="floor")
                    for d in dest[dest != rank].tolist():
                        sent[0 if d // NODE == rank // NODE else 1] += 2 * row  # dispatch forward, combine backward
                        back[d] += 1
                dist.all_to_all_single(got := torch.zeros(world, dtype=torch.float64), back)  # slots sent to me, by peer
                for src, n in enumerate(got.tolist()):
                    sent[0 if src // NODE == rank // NODE else 1] += 2 * row * n  # combine forward, dispatch backward
                counted = [stats.intra_node_bytes(sites_of(only=(Site.EXPERTS_DISPATCH, Site.EXPERTS_COMBINE))),
                           stats.inter_node_bytes(sites_of(only=(Site.EXPERTS_DISPATCH, Site.EXPERTS_COMBINE)))]  # fmt: skip
                assert counted == sent, (where, counted, sent)
                totals = torch.tensor([*counted, sum(len(e) for e in recorded)], dtype=torch.float64)
                dist.all_reduce(totals)
                costs = CostsConfig(recompute="none", ep_degree=ep, ep_placement="intra" if ep <= NODE else "inter")
                sim = simulate(plan, CostModel(cfg, HardwareConfig(bytes_per_element=8), costs=costs))
                assert (sim.moe_intra_bytes > 0) == (ep > 1) and (sim.moe_inter_bytes > 0) == (ep > NODE), where
                p_leave, slots = (ep - 1) / ep, float(totals[2])
                sigma = 4 * row * np.sqrt(slots * p_leave * (1 - p_leave))  # four passes of one slot's row
                got_bytes, want = float(totals[0] + totals[1]), sim.moe_intra_bytes + sim.moe_inter_bytes
                spreads.append((got_bytes - want) / sigma)
                assert abs(got_bytes - want) <= 4 * sigma, (where, got_bytes, want, sigma)
    ExpertDispatch.__call__ = run
    # replicated parameters (no FSDP2): the experts' gradients sum over their replicas only, the rest
    # over the world; the same loss and gradients (MHA, the paper's best plan, each EP degree)
    cfg, (ref_loss, ref_grads) = CONFIGS["mha"], refs["mha"]
    plan = next(p for p in solver_plans(cfg) if p.label == "repack+solver")
    for ep in EPS:
        per = cfg.n_experts // ep
        mine = slice((rank % ep) * per, (rank % ep + 1) * per)
        model = replicate_experts(make_model(cfg).expert_parallel(ep, rank))
        loss = run_step(model, plan, sample_tokens(LENGTHS), groups, "torch", "torch")
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12, msg=f"replicated EP{ep}")
        for n, p in model.named_parameters():
            want = ref_grads[n][mine] if ".experts." in n else ref_grads[n]
            torch.testing.assert_close(p.grad, want, rtol=1e-9, atol=1e-11, msg=f"replicated EP{ep} {n}")
    if rank == 0:
        print(f"counted against expected experts' bytes, in standard deviations: {np.round(spreads, 2).tolist()}")


@pytest.mark.slow
def test_expert_parallel_step_matches_single_process_and_moves_the_routings_bytes():
    refs = {name: reference(LENGTHS, cfg) for name, cfg in CONFIGS.items()}
    run_distributed(_body, WORLD, refs)


@pytest.mark.slow
def test_bad_expert_parallel_settings_fail_before_step_1_naming_the_flag(tmp_path):
    from tests.dist_utils import forked_driver

    cases = [
        (("--ep", "8"), "costs.ep_degree (--ep)=8 does not divide model.n_experts (--n-experts)=4"),
        (("--ep", "4", "--gpus-per-node", "1"), "costs.ep_degree (--ep)=4 is wider than a node of 1 ranks (--gpus-per-node)"),
        (("--ep", "4", "--ep-placement", "inter", "--gpus-per-node", "1"), "costs.ep_degree (--ep)=4 does not divide the world of 1"),
    ]
    for args, message in cases:
        p = forked_driver(1, "--steps", "1", *args, "--out", str(tmp_path / "o"))
        assert p.returncode != 0 and message in p.stderr, (args, p.stderr[-2000:])
        assert " loss " not in p.stdout, f"{args}: no step may run"
