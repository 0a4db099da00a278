"""The other ways to run the sparse layers, over gloo: 8 forked ranks in nodes of 2, fp64.

For redistribute (the layout changed by an all-to-all of its own at every full/sparse boundary),
halo children, the parent's own layout with halo attention, and the per-parent choice; with a
sliding window and a chunked sparse kind, MHA and GQA: the solver's plans and hand-made ones (a
halo child across nodes whose window reaches two ranks back, a halo child of two samples, empty
chunks, a redistribution of a repacked parent):
- the loss and every gradient equal the single-process run (replicated parameters; and once under
  FSDP2 with expert parallelism);
- the bytes every rank counted at each site (the full layers' exchanges and redistributions, the
  sparse layers' exchanges and halos) equal, summed, the simulator's for the same plan.
"""

import pytest
import torch
import torch.distributed as dist

from config import Cluster, CostsConfig, HardwareConfig, ModelConfig
from kernels.exchange import CommStats, ExchangeGroups
from model.distributed import run_step
from model.sharding import full_tensor, shard_model
from solver import CostModel, Group, ParentPlan, StepPlan, Way, make_plan, samples_from_lengths
from solver.halo import own_layout_halo
from solver.simulator import simulate
from solver.sites import Family, Site, sites_of
from tests import test_model_distributed
from tests.dist_utils import run_distributed
from tests.test_model_distributed import LENGTHS, NODE, WORLD, make_model, reference, sample_tokens

NEW_MODES = ("redistribute", "halo", "parent+halo", "choose")
KINDS = {"window": ("sliding_window", {"window": 8}), "chunked": ("chunked", {"chunk": 8})}
CONFIGS = {
    f"{heads}-{kind}": ModelConfig.from_name("tiny" if heads == "mha" else "tiny-gqa", aux_loss_coef=0.01, sparse_kind=k, sparse_params=p)
    for heads in ("mha", "gqa")
    for kind, (k, p) in KINDS.items()
}
CLUSTER = Cluster(WORLD, NODE, 32)
TINY = CONFIGS["mha-window"]
assert TINY == test_model_distributed.CFG  # the same model: its solver plans run there


def hand_plans() -> list[StepPlan]:
    lengths = tuple(enumerate(LENGTHS))
    parent = Group(0, 8, tuple(range(len(LENGTHS))))
    # sample 0 over ranks 0-1; samples 1 and 2 over ranks 2-4 (across nodes 1 and 2), chunks of 5-8
    # tokens that a window of 8 reaches two ranks back over; the rest in Ulysses children
    kids = (Group(0, 2, (0,), Way.HALO), Group(2, 3, (1, 2), Way.HALO), Group(5, 1, (3, 4, 5, 6)), Group(6, 2, (7, 8, 9)))
    halo = StepPlan(CLUSTER, lengths, (ParentPlan(parent, kids),), "halo").validate()
    naive = StepPlan(CLUSTER, lengths, (own_layout_halo(parent),), "parent+halo").validate()  # 5 samples shorter than the parent
    ulysses = (Group(0, 2, (0,)), Group(2, 1, (1,)), Group(3, 1, (2, 3)), Group(4, 2, (4, 5, 6)), Group(6, 1, (7, 8)), Group(7, 1, (9,)))
    redistribute = StepPlan(CLUSTER, lengths, (ParentPlan(parent, ulysses, redistributed=True),), "redistribute").validate()
    return [halo, naive, redistribute]


def plans(cfg: ModelConfig) -> list[StepPlan]:
    """The solver's plans in NEW_MODES and the hand-made ones; for the tiny model's own sparse kind
    and heads (MHA, a window of 8) the hand-made ones only: tests/test_model_distributed.py runs
    every mode's plan of that model, loss, gradients and bytes."""
    cost = CostModel(cfg, HardwareConfig())
    solved = [] if cfg == TINY else [make_plan(samples_from_lengths(LENGTHS), CLUSTER, cost, m) for m in NEW_MODES]
    return solved + hand_plans()


def counted(stats: CommStats) -> list[float]:
    t = torch.tensor(
        [f(sites_of(fam)) for fam in (Family.FULL, Family.SPARSE) for f in (stats.intra_node_bytes, stats.inter_node_bytes)],
        dtype=torch.float64,
    )
    dist.all_reduce(t)
    return t.tolist()


def assert_step(cfg: ModelConfig, plan: StepPlan, ref, groups: ExchangeGroups, where: str) -> CommStats:
    """One step of `plan` (replicated parameters, fp64): the loss and every gradient equal the
    single-process `ref`, the bytes every rank counted at each site, summed, the simulator's, and
    every site a rank called timed, forward and backward (`--timers`: the emulated comparison
    splits the measured step by these timers, and a call left untimed lands in the rest)."""
    ref_loss, ref_grads = ref
    model = make_model(cfg)
    stats = CommStats(gpus_per_node=NODE, timed=True)
    loss = run_step(model, plan, sample_tokens(LENGTHS), groups, "torch", "torch", stats)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12, msg=where)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-9, atol=1e-11, msg=f"{where} {n}")
    sim = simulate(plan, CostModel(cfg, HardwareConfig(bytes_per_element=8), costs=CostsConfig(recompute="none", ep_degree=1)))
    priced = [sim.full_intra_bytes, sim.full_inter_bytes, sim.sparse_intra_bytes, sim.sparse_inter_bytes]
    assert counted(stats) == pytest.approx(priced, rel=1e-12, abs=0), (where, counted(stats), priced)
    untimed = sorted(set(stats.calls) - {site for site, parts in stats.seconds.items() if "all_to_all" in parts})
    assert not untimed, f"{where}: sites called but not timed: {untimed}"
    return stats


def _body(rank, world, refs):
    groups = ExchangeGroups(world)
    for name, cfg in CONFIGS.items():
        for plan in plans(cfg):
            where = f"{name} {plan.label} {plan.hash}"
            stats = assert_step(cfg, plan, refs[name], groups, where)
            if plan.label == "halo" and plan.parents[0].children[1].halo:  # the hand plan: halos cross nodes
                crossing = torch.tensor([float(stats.inter_node_bytes(sites_of(only=(Site.SPARSE_HALO,))))])
                dist.all_reduce(crossing)
                assert crossing.item() > 0, where
    # FSDP2 with expert parallelism (EP2) under halo children and a redistribution: the same numbers
    cfg = CONFIGS["gqa-window"]
    ref_loss, ref_grads = refs["gqa-window"]
    for plan in hand_plans()[0::2]:
        assert_sharded_ep2_step(cfg, plan, (ref_loss, ref_grads), groups, rank)


def assert_sharded_ep2_step(cfg: ModelConfig, plan: StepPlan, ref, groups: ExchangeGroups, rank: int, recompute: str = "none") -> None:
    """One step of `plan` under FSDP2 with expert parallelism of degree 2 (fp64): the loss equals
    the single-process `ref`, and every gathered gradient its own, the experts' this rank's slot of them."""
    ref_loss, ref_grads = ref
    model = shard_model(make_model(cfg, recompute).expert_parallel(2, rank), torch.device("cpu"))
    loss = run_step(model, plan, sample_tokens(LENGTHS), groups, "torch", "torch")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    per = cfg.n_experts // 2
    mine = slice((rank % 2) * per, (rank % 2 + 1) * per)
    for n, p in model.named_parameters():
        want = ref_grads[n][mine] if ".experts." in n else ref_grads[n]
        torch.testing.assert_close(full_tensor(p.grad), want, rtol=1e-9, atol=1e-11, msg=f"fsdp ep2 {plan.label} {recompute} {n}")


@pytest.mark.slow
def test_every_way_to_run_the_sparse_layers_matches_single_process_and_moves_the_priced_bytes():
    refs = {name: reference(LENGTHS, cfg) for name, cfg in CONFIGS.items()}
    run_distributed(_body, WORLD, refs)


def test_the_plans_cover_what_the_test_claims():
    for cfg in CONFIGS.values():
        got = {p.label for p in plans(cfg)}
        hand_made = {"halo", "parent+halo", "redistribute"}
        assert got == (hand_made if cfg == TINY else set(NEW_MODES)), got
    halo, naive, redistribute = hand_plans()
    wide = halo.parents[0].children[1]
    assert wide.halo and wide.start // NODE != (wide.stop - 1) // NODE and len(wide.samples) == 2
    assert any(LENGTHS[s] < naive.parents[0].group.size for s in naive.parents[0].group.samples)  # empty chunks
    assert redistribute.parents[0].repacked and redistribute.redistributes  # the runtime and the simulator read the plan


def test_halo_children_refuse_a_sparse_kind_without_a_reach():
    from config import SettingError
    from model.attention import register_sparse_attention
    from solver.cost import attention_flops

    register_sparse_attention(
        "strided_noreach",
        mask=lambda qp, kp, p: (qp - kp) < 2,
        flops=lambda n, cfg: attention_flops(n, cfg),
        overwrite=True,
    )
    cfg = ModelConfig.from_name("tiny", sparse_kind="strided_noreach", sparse_params={})
    cost = CostModel(cfg, HardwareConfig())
    for mode in ("halo", "parent+halo"):
        with pytest.raises(SettingError, match=r"sparse kind 'strided_noreach' declares no reach .* mode " + mode.replace("+", r"\+")):
            make_plan(samples_from_lengths(LENGTHS), CLUSTER, cost, mode)
    plan = make_plan(samples_from_lengths(LENGTHS), CLUSTER, cost, "choose")  # the choice without halo children
    assert not any(c.halo for p in plan.parents for c in p.children)
    assert "sliding_window" in str(pytest.raises(SettingError, cost.sparse.check_local).value)  # names the kinds that have one
