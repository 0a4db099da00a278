"""The core equivalence: a distributed step (8 gloo ranks, nodes of 2) under every mode's plan
gives the single-process loss and gradients, with both pack paths, with replicated parameters
and with FSDP2-sharded ones; and the bytes its exchanges count are the bytes the simulator prices
for the plan, and the bytes FSDP2's gathers and reductions send are the ones it prices. (The
other sparse kinds and hand-made plans of the other ways to run the sparse layers:
tests/test_strategies_distributed.py.)"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

import model.distributed as model_distributed
from config import Cluster, CostsConfig, HardwareConfig, ModelConfig
from kernels.exchange import CommStats, ExchangeGroups
from model import HybridMoE, LocalPlacement, next_token_labels
from model.distributed import LayoutError, label_count, run_step, validate
from model.sharding import full_tensor, shard_model
from solver import CostModel, Group, ParentPlan, StepPlan, make_plan, samples_from_lengths
from solver.modes import MODES
from solver.simulator import simulate
from solver.sites import Family, Site, sites_of
from tests.dist_utils import ShardCollectives, run_distributed
from tests.test_gpu import BF16_LOSS_RTOL

WORLD, NODE = 8, 2
CFG = ModelConfig.from_name("tiny", aux_loss_coef=0.01)
# grouped-query attention with 2 key/value heads: the SP8 parent replicates each over 4 ranks, the
# SP4 groups over 2, the SP2 children split them
# and value heads of their own size, 12 beside q/k heads of 8 (MLA's kind of heads): the exchanges
# move element j of every q, k and v head as a part (solver.kinds.attention_parts), halo rows a
# token's keys and values flattened (GQA with one head size: tests/test_strategies_distributed.py)
GQA = ModelConfig.from_name("tiny-gqa", aux_loss_coef=0.01, v_head_dim=12)
CONFIGS = {"mha": CFG, "gqa": GQA}
LENGTHS = [61, 23, 17, 9, 7, 5, 3, 2, 1, 11]


def sample_tokens(lengths):
    rng = np.random.default_rng(7)
    return {i: rng.integers(0, CFG.vocab, n) for i, n in enumerate(lengths)}


def make_model(cfg=CFG, recompute="none"):
    torch.manual_seed(0)
    return HybridMoE(cfg, recompute).double()


def hand_plans():
    """The same wide parent over all 8 ranks, repacked into node-local children or not."""
    lengths = tuple(enumerate(LENGTHS))
    parent = Group(0, 8, tuple(range(len(LENGTHS))))
    kids = (Group(0, 2, (0,)), Group(2, 1, (1,)), Group(3, 1, (2, 3)), Group(4, 2, (4, 5, 6)), Group(6, 1, (7, 8)), Group(7, 1, (9,)))
    cluster = Cluster(WORLD, NODE, 32)
    base = StepPlan(cluster, lengths, (ParentPlan(parent, (parent,), "repacking disabled (baseline)"),), "baseline").validate()
    rep = StepPlan(cluster, lengths, (ParentPlan(parent, kids, ""),), "repack").validate()
    return base, rep


def idle_rank_plan():
    """A baseline plan in which rank 7 holds no token: its attention and experts see nothing, and
    its parameters must still get (zero) gradients, or FSDP2's reduce-scatters differ across ranks."""
    lengths = tuple(enumerate(LENGTHS))
    groups = (Group(0, 4, (0, 1)), Group(4, 2, (2, 3, 4)), Group(6, 1, (5, 6, 7, 8, 9)), Group(7, 1, ()))
    parents = tuple(ParentPlan(g, (g,), "baseline") for g in groups)
    return StepPlan(Cluster(WORLD, NODE, 32), lengths, parents, "baseline").validate()


def solver_plans(cfg=CFG):
    cost = CostModel(cfg, HardwareConfig())
    return [make_plan(samples_from_lengths(LENGTHS), Cluster(WORLD, NODE, 32), cost, m) for m in MODES]


def distinct_layouts(plans):
    """The plans whose parents and children no earlier plan has: modes that plan the same layout
    run the same step (the runtime reads the plan, never its mode), so each layout runs once."""
    seen, out = set(), []
    for plan in plans:
        if plan.parents not in seen:  # frozen records: equal parents, children and reasons
            seen.add(plan.parents)
            out.append(plan)
    return out


def reference(lengths, cfg=CFG):
    toks = sample_tokens(lengths)
    model = make_model(cfg)
    ids = list(range(len(lengths)))
    tokens = torch.as_tensor(np.concatenate([toks[i] for i in ids]))
    labels = torch.as_tensor(np.concatenate(next_token_labels([toks[i] for i in ids])))
    loss = model.loss(tokens, labels, LocalPlacement(lengths, cfg, "torch"), sum(n - 1 for n in lengths))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _body(rank, world, refs):
    groups = ExchangeGroups(world)
    base, rep = hand_plans()
    for name, cfg in CONFIGS.items():
        # gradients all-reduced in one flat bucket (mha), or in buckets of 5 KB (gqa: many buckets,
        # and parameters larger than a bucket alone in theirs)
        model_distributed.BUCKET_BYTES = 25 << 20 if name == "mha" else 5000
        ref_loss, ref_grads = refs[name]
        counts = {}
        # every mode's solver plan for the plain heads (each layout once); for GQA a solver plan with
        # a halo child and the hand-made ones, which hold the replicated (SP8) and split (SP2) key/value heads
        plans = distinct_layouts(solver_plans(cfg))
        if name == "gqa":  # one plan with a halo child (v's rows flattened into the halo's)
            plans = [p for p in plans if any(c.halo for par in p.parents for c in par.children)][:1]
        for plan in plans + [base, rep]:
            # the Triton kernels move data bit-exactly like the torch pack, for plain and replicated
            # key/value heads (test_kernels); here they run once, on the hand-made repacked plan of
            # the plain heads, to show the whole step through them (interpreted: most of this test's time)
            for pack in ("torch", "triton") if plan is rep and name == "mha" else ("torch",):
                model = make_model(cfg)
                stats = CommStats(gpus_per_node=NODE)
                loss = run_step(model, plan, sample_tokens(LENGTHS), groups, pack, "torch", stats)
                torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
                for n, p in model.named_parameters():
                    torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-9, atol=1e-11, msg=f"{name} {plan.label} {pack} {n}")
                counts[(plan.hash, pack)] = stats
                if pack == "torch":  # the bytes every rank counted, summed, are the bytes the simulator prices
                    assert_priced(plan, stats, cfg, "none", f"{name} {plan.label}")
        if name == "mha":  # FSDP2: the same loss, and the gathered gradients, in the paper's three modes
            # with each activation-recompute setting once (recompute re-runs exchanges and kernels:
            # the same numbers)
            recomputes = ["full", "selective", "none", "full"]
            for plan, recompute in zip(solver_plans(cfg)[:3] + [idle_rank_plan()], recomputes):
                model = shard_model(make_model(cfg, recompute), torch.device("cpu"))
                with ShardCollectives() as sync:
                    loss = run_step(model, plan, sample_tokens(LENGTHS), groups, "torch", "torch")
                assert_sync_priced(sync, cfg, world, 1, f"fsdp {plan.label} recompute {recompute}")
                torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
                for n, p in model.named_parameters():
                    torch.testing.assert_close(full_tensor(p.grad), ref_grads[n], rtol=1e-9, atol=1e-11, msg=f"fsdp {plan.label} {n}")
        if name == "mha":  # a GPU run's replicated path: bf16 autocast, the gradients all-reduced in fp32
            fp32 = run_step(make_model(cfg).float(), rep, sample_tokens(LENGTHS), groups, "torch", "torch")
            bf16 = run_step(make_model(cfg).float(), rep, sample_tokens(LENGTHS), groups, "torch", "torch", autocast_dtype=torch.bfloat16)
            torch.testing.assert_close(bf16, fp32, rtol=BF16_LOSS_RTOL, atol=0)
        b, r = counts[(base.hash, "torch")], counts[(rep.hash, "torch")]
        # the repacked step issues exactly the baseline's all-to-alls at the full site, nothing else ...
        assert r.total_calls(sites_of(Family.FULL)) == b.total_calls(sites_of(Family.FULL)) == 2 * 2 * cfg.n_full
        sites = sites_of(only=(Site.FULL_ENTRY, Site.FULL_EXIT, Site.SPARSE_ENTRY, Site.SPARSE_EXIT))
        assert set(r.calls) <= sites
        # ... and its sparse layers send nothing across emulated nodes, where the baseline's do: in the
        # baseline every rank holds a slice of the 8-rank parent's tokens and sends some to other nodes
        assert r.inter_node_bytes(sites_of(Family.SPARSE)) == 0
        assert b.inter_node_bytes(sites_of(Family.SPARSE)) > 0
        # with full recompute each exchange's forward runs again in the backward: priced so too
        recounted = CommStats(gpus_per_node=NODE)
        run_step(make_model(cfg, "full"), rep, sample_tokens(LENGTHS), groups, "torch", "torch", recounted)
        assert_priced(rep, recounted, cfg, "full", f"{name} recompute")


def assert_priced(plan, stats: CommStats, cfg, recompute: str, where: str) -> None:
    """The bytes every rank counted at each site, summed over the ranks, equal the simulator's for
    the same plan (fp64 elements; without recompute each exchange runs forward and backward once)."""
    counted = torch.tensor(
        [f(sites_of(fam)) for fam in (Family.FULL, Family.SPARSE) for f in (stats.intra_node_bytes, stats.inter_node_bytes)],
        dtype=torch.float64,
    )
    dist.all_reduce(counted)
    sim = simulate(plan, CostModel(cfg, HardwareConfig(bytes_per_element=8), costs=CostsConfig(recompute=recompute)))
    priced = [sim.full_intra_bytes, sim.full_inter_bytes, sim.sparse_intra_bytes, sim.sparse_inter_bytes]
    assert counted.tolist() == priced, (where, counted.tolist(), priced)


def assert_sync_priced(sync, cfg, world: int, ep: int, where: str) -> None:
    """The bytes this rank's FSDP2 gathers and reductions sent in a step, and how many it called,
    equal what the simulator prices for the model (CostModel.grad_sync_volume, fp64 elements)."""
    costs = CostsConfig(param_bytes=8, grad_bytes=8, ep_degree=ep, ep_placement="intra" if ep <= NODE else "inter")
    gather, reduce, calls = CostModel(cfg, HardwareConfig(), costs=costs).grad_sync_volume(world)
    counted = (sync.sent["all_gather_single"], sync.sent["reduce_scatter_single"], sum(sync.calls.values()))
    assert counted == pytest.approx((gather, reduce, calls), rel=1e-12), (where, counted, (gather, reduce, calls))


@pytest.mark.slow
def test_distributed_step_matches_single_process_in_every_mode():
    refs = {name: reference(LENGTHS, cfg) for name, cfg in CONFIGS.items()}  # once, here; every rank compares with them
    run_distributed(_body, WORLD, refs)


def test_solver_plans_cover_the_cases_the_equivalence_test_claims():
    for cfg in CONFIGS.values():
        plans = solver_plans(cfg)
        assert any(p.group.size > NODE for plan in plans for p in plan.parents), "a parent must span emulated nodes"
    assert any(p.group.size > GQA.n_kv_heads for plan in solver_plans(GQA) for p in plan.parents), "a group must replicate KV heads"
    assert any(c.halo for plan in solver_plans(GQA) for p in plan.parents for c in p.children), "a halo child must pass v's rows"
    base, rep = hand_plans()
    assert rep.parents[0].repacked and all(c.size <= NODE for c in rep.parents[0].children)


def test_validation_names_the_problem():
    base, _ = hand_plans()
    with pytest.raises(LayoutError, match="the plan is for 8 ranks but the process group has 4"):
        validate(base, CFG, 4)
    with pytest.raises(LayoutError, match="n_kv_heads=3 neither divides nor is divided by group size 8"):
        validate(base, CFG.replace(n_kv_heads=3, n_heads=24), 8)
    with pytest.raises(LayoutError, match="n_heads=4 is not divisible by group size 8"):
        validate(base, CFG.replace(n_heads=4, n_kv_heads=2), 8)
    validate(base, GQA, 8)  # 2 key/value heads on 8 ranks: replicated, runs
    assert label_count(base) == sum(LENGTHS) - len(LENGTHS)
