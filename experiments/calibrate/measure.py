"""The calibration's measurements and fits (its entry point: python -m experiments.calibrate).

On the process group it is launched on (NCCL on GPUs, gloo on CPU), with every rank busy at
once as in a training step, it measures:
1. the exchange time (pack, all-to-all, unpack, as the runtime runs it) against bytes for every
   aligned group size, every group of that size running at once: groups inside a node and
   groups across nodes;
2. the token-wise compute of the model's layers (projections, router and experts, forward and
   backward) on a step's tokens per rank;
3. full and sparse attention (the model's sparse kind, the attention backend in use) against
   sample length, forward and backward; a linear kind's mixer (convolution, gates, recurrence)
   in place of sparse attention, with all heads and with one key head's, on one sample and on
   many short ones, so that its rate and what each block of its recurrence costs a rank
   whatever its heads (linear_block_latency) separate;
4. the device's matmul peak (a large square product) and memory bandwidth (a large copy);
5. fixed costs: a whole layer forward and backward on one token, one small all-reduce of the
   world (what the gradient sync's and the router's collectives pay whatever their size), and
   the driver's whole step (FSDP2, full recompute) on 2 tokens per rank (--step-tokens) in four plans: every
   rank alone, groups of a node's ranks, groups across nodes (the widest the heads allow), and
   groups of a node's ranks whose sparse layers run by halo exchange (and every rank alone again
   on replicated parameters: what FSDP2's gathers and reductions add, whose hidden share it
   fits, before the rest). In that order each plan
   fits one fixed cost, the value that makes the simulator's price of the step equal its
   measured time: the layer's per pass, an all-to-all call's latency, what a call across nodes
   adds, a halo call's latency. The four steps are timed in rounds (every step once a round) and
   fitted round by round, each cost's figure the median of its rounds' fits. Each is kept where
   it is above the isolated measurement's (the
   sharding and recompute hooks, and the collectives and scheduling around a call in a step, are
   fixed costs a bare layer and a lone all-to-all leave out); the halo call's, which has no
   isolated measurement, as fitted.
Each time is the slowest rank's, the median over repeats. It fits the cost model's hardware
parameters: intra_node_bw and a2a_latency from the groups inside a node; the inter-node rate
and the latency a call across nodes adds (a2a_inter_latency) under both readings of the ratio
(group: an all-to-all across nodes runs, as a whole, at one rate; link: each peer's bytes at its
link's rate), the reading with the smaller residual kept (every fit minimizes the relative
residual it prints, so the small transfers and short samples a step is made of count as much as
the large ones);
gemm_efficiency, attention_efficiency and (a linear kind's) linear_efficiency against the measured peak (only peak x efficiency
enters a step time, so the prediction does not depend on that choice; --peak-flops sets a
datasheet peak for MFU). It prints every fit with its residuals and writes the profile: JSON with
the hardware config, the measurements, the fits, and device, world, commit and date.
"""

from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist

from config import Cluster, CostsConfig, HardwareConfig, ModelConfig, SettingError
from config.entries import STEP_SAMPLE_TOKENS
from experiments.common.provenance import provenance
from experiments.common.steps import runtime_step_plan, step_device, time_runtime_steps, timed
from kernels.exchange import ExchangeGroups
from model import HybridMoE, varlen_attention
from model.attention import resolve_backend
from solver import CostModel
from solver.cost import FLOPS_PER_MAC, FWD_BWD_COMPUTE, attention_flops, causal_keys, sparse_cost
from solver.sites import Family, sites_of

# what is measured: bytes per peer of the all-to-alls, median-of runs, sample lengths of attention, tokens of the token-wise work
QUICK = {"bytes": [1 << 10, 1 << 16, 1 << 20], "median_of": 3, "lengths": [32, 64, 128], "tokens": 64}
FULL = {"bytes": [1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20], "median_of": 7, "lengths": [64, 256, 1024, 2048], "tokens": None}


# ----- 1. all-to-all --------------------------------------------------------------------------------
def measure_all_to_all(groups: ExchangeGroups, node: int, sizes: list[int], cfg: ModelConfig, device, dtype, repeats: int) -> list[dict]:
    """Seconds of one entry exchange as the runtime runs it (pack, all_to_all_single, unpack:
    kernels.exchange) of the model's Q, K and V heads, per (group size, bytes per peer), every
    aligned group of that size at once; bytes per peer exclude a rank's own slice. Each group holds
    one sample, a chunk of it on each rank."""
    from kernels.exchange import dist_transport, exchange, exchange_args  # noqa: PLC0415
    from solver import Group, TokenLayout, token_to_head_rank  # noqa: PLC0415

    rank, world = dist.get_rank(), dist.get_world_size()
    head_counts = [cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads]
    row = sum(head_counts) * cfg.head_dim * torch.tensor([], dtype=dtype).element_size()  # one token's Q, K and V
    transport = dist_transport(groups)
    rows, p = [], 2
    while p <= world:
        for per_peer in sizes:
            n = max(1, per_peer * p // row)  # tokens per rank: each peer gets 1/p of every token's heads
            layout = TokenLayout(tuple(Group(s, p, (s,)) for s in range(0, world, p)), {s: n * p for s in range(0, world, p)})
            args = exchange_args(token_to_head_rank(layout, layout, rank), head_counts, device)
            x = torch.zeros(n, sum(head_counts), cfg.head_dim, device=device, dtype=dtype)
            t = timed(lambda: exchange(x, args, transport, "torch"), device, repeats)  # noqa: B023
            rows.append({"group_size": p, "spans_nodes": p > node, "bytes_per_peer": n * row // p, "seconds": t})
        p *= 2
    return rows


def measure_experts_all_to_all(
    groups: ExchangeGroups, node: int, sizes: list[int], cfg: ModelConfig, device, dtype, repeats: int
) -> list[dict]:
    """Seconds of the experts' dispatch as the runtime runs its data path (the row gather of the
    slots, then the all-to-all: model.experts) of hidden-size rows, per (EP group size, bytes per
    peer), every aligned group of that size at once, each peer getting as many rows (uniform
    routing); bytes per peer exclude a rank's own share. The rows of measure_all_to_all."""
    from kernels.exchange import all_to_all_rows  # noqa: PLC0415
    from model.experts import gather_slots  # noqa: PLC0415

    rank, world = dist.get_rank(), dist.get_world_size()
    row = cfg.hidden * torch.tensor([], dtype=dtype).element_size()
    out, p = [], 2
    while p <= world:
        group = groups.get(rank - rank % p, p)
        for per_peer in sizes:
            each = max(1, per_peer // row)  # rows to each peer
            x = torch.zeros(each * p, cfg.hidden, device=device, dtype=dtype)
            order = torch.arange(each * p, device=device)

            def dispatch(x=x, order=order, each=each, group=group, p=p):
                all_to_all_rows(gather_slots(x, order, order, 1), [each] * p, [each] * p, group)

            out.append(
                {"group_size": p, "spans_nodes": p > node, "bytes_per_peer": each * row, "seconds": timed(dispatch, device, repeats)}
            )
        p *= 2
    return out


def measure_experts_overlap(cfg: ModelConfig, groups: ExchangeGroups, node: int, device, dtype, repeats: int, tokens: int) -> dict:
    """The share of the experts' all-to-all that the runtime hides behind compute, from the
    driver's timers: its whole step (run_step, FSDP2, full recompute) with expert parallelism of
    the cost model's default degree and without, on `tokens` tokens per rank each alone (no
    exchange), and the step's all-to-all seconds as its timers see them (CommStats, every
    moe call): hidden = 1 - (step with EP - step without) / those seconds, within [0, 1].
    Without expert parallelism to measure (one rank a node, or experts that do not split), None."""
    from kernels.exchange import CommStats  # noqa: PLC0415
    from model.distributed import run_step  # noqa: PLC0415
    from model.sharding import shard_model  # noqa: PLC0415

    world, rank = dist.get_world_size(), dist.get_rank()
    ep = CostModel(cfg, HardwareConfig()).for_cluster(Cluster(world, node, tokens)).ep_degree
    if ep == 1:
        return {"ep_degree": 1, "moe_overlap": None}
    plan = runtime_step_plan(world, node, 1, tokens)
    gen = np.random.default_rng(0)
    batch = {k: gen.integers(0, cfg.vocab, n) for k, n in plan.lengths}
    steps, moe = {}, []
    for degree in (1, ep):
        torch.manual_seed(0)
        model = HybridMoE(cfg, "full").to(device=device, dtype=dtype)
        if degree > 1:
            model.expert_parallel(degree, rank)
        shard_model(model, device)

        def step(model=model, degree=degree):
            stats = CommStats(gpus_per_node=node, timed=True)
            run_step(model, plan, batch, groups, stats=stats)
            model.zero_grad(set_to_none=True)
            if degree > 1:
                moe.append(stats.exchange_seconds(sites_of(Family.EXPERTS), part="all_to_all"))

        steps[degree] = timed(step, device, repeats)
    calls = torch.tensor([float(np.median(moe))], dtype=torch.float64, device=device)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    exposed = steps[ep] - steps[1]
    hidden = float(np.clip(1 - exposed / float(calls), 0.0, 1.0)) if float(calls) > 0 else 0.0
    return {
        "ep_degree": ep,
        "tokens": tokens,
        "step_s": steps[1],
        "step_ep_s": steps[ep],
        "all_to_all_s": float(calls),
        "moe_overlap": hidden,
    }


def _lstsq(x: np.ndarray, y: np.ndarray, measured: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """y ~ x @ coef minimizing the relative RMS residual it returns, relative to the measured
    times (default y; y is what is left of them once known parts are taken off): a small transfer
    or a short sample, what a step is made of, weighs as much as a large one. (coef, residual)."""
    scale = y if measured is None else measured
    coef, *_ = np.linalg.lstsq(x / scale[:, None], y / scale, rcond=None)
    return coef, float(np.sqrt(np.mean(((x @ coef - y) / scale) ** 2)))


def _fixed_and_slope(x: np.ndarray, y: np.ndarray, measured: np.ndarray) -> tuple[float, float]:
    """y ~ fixed + x * slope (_lstsq) with fixed >= 0 (refit through the origin when the intercept
    comes out negative) and slope > 0 (kept finite where noise swamps it)."""
    (fixed, slope), _ = _lstsq(np.stack([np.ones_like(x), x], 1), y, measured)
    if fixed < 0:
        fixed, slope = 0.0, float(_lstsq(x[:, None], y, measured)[0][0])
    return float(fixed), max(float(slope), 1e-15)


def _fixed_peers_and_slope(x: np.ndarray, peers: np.ndarray, y: np.ndarray, measured: np.ndarray) -> tuple[float, float, float]:
    """y ~ fixed + peers * per_peer + x * slope (_lstsq), each of fixed and per_peer >= 0 (a
    negative one is dropped and the rest refitted, as _fixed_and_slope does for its intercept)."""
    (fixed, per_peer, slope), _ = _lstsq(np.stack([np.ones_like(x), peers, x], 1), y, measured)
    if per_peer < 0:
        fixed, slope = _fixed_and_slope(x, y, measured)
        return fixed, 0.0, slope
    if fixed < 0:
        per_peer, slope = _lstsq(np.stack([peers, x], 1), y, measured)[0]
        if per_peer < 0:
            return 0.0, 0.0, float(max(_lstsq(x[:, None], y, measured)[0][0], 1e-15))
        fixed = 0.0
    return float(fixed), float(per_peer), max(float(slope), 1e-15)


def fit_all_to_all(rows: list[dict], node: int) -> dict:
    """intra_node_bw and a2a_latency from the groups inside a node; from the groups across nodes,
    the inter-node rate, the latency a call across nodes adds (a2a_inter_latency) and, where the
    groups across nodes have two sizes or more, what each peer past the first adds to a call
    (a2a_peer_latency: a call sends to and receives from each peer in turn; 0 from one size,
    where it cannot be told from the rest), under the group and the link reading, each with its
    relative RMS residual."""
    intra = [r for r in rows if not r["spans_nodes"]]
    inter = [r for r in rows if r["spans_nodes"]]
    out: dict = {}
    if not intra:
        raise SettingError("no group inside a node to measure: launch at least 2 ranks per node (--gpus-per-node >= 2)")
    sent = np.array([r["bytes_per_peer"] * (r["group_size"] - 1) for r in intra], dtype=np.float64)
    t = np.array([r["seconds"] for r in intra])
    (lat, inv_bw), _ = _lstsq(np.stack([np.ones_like(sent), sent], 1), t)
    lat = max(float(lat), 0.0)
    if inv_bw <= 0:  # noise swamps the slope: the rate from the largest transfer over the latency
        big = int(np.argmax(sent))
        # where even it took no longer than the latency, its whole time bounds the rate (a 1 ps floor
        # put the rate at 1e18 B/s, which no hardware setting accepts)
        inv_bw = (t[big] - lat if t[big] > lat else t[big]) / sent[big]
    res = float(np.sqrt(np.mean(((lat + sent * inv_bw - t) / t) ** 2)))
    out["intra"] = {"a2a_latency": lat, "intra_node_bw": 1.0 / float(inv_bw), "rel_rms": res, "points": len(intra)}
    if inter:
        y = np.array([r["seconds"] for r in inter])
        per_peer = np.array([r["bytes_per_peer"] for r in inter], dtype=np.float64)
        size = np.array([r["group_size"] for r in inter], dtype=np.float64)
        intra_peers = np.minimum(size, node) - 1
        inter_peers = size - 1 - intra_peers
        intra_part = per_peer * intra_peers / out["intra"]["intra_node_bw"]
        # group: the whole exchange at the inter rate; link: intra peers at the intra rate, inter
        # peers at the inter rate; both on top of the latency inside a node plus what crossing adds
        peers = np.maximum(size - 2, 0.0)  # past the first: the groups inside a node, of 2, pay none
        sizes = sorted({int(v) for v in size})
        fits = {}
        for name, x, known in (("group", per_peer * (size - 1), 0.0), ("link", per_peer * inter_peers, intra_part)):
            if len(sizes) > 1:
                extra, peer, inv = _fixed_peers_and_slope(x, peers, y - lat - known, y)
            else:
                (extra, inv), peer = _fixed_and_slope(x, y - lat - known, y), 0.0
            pred = lat + extra + peer * peers + known + x * inv
            fits[name] = {
                "inter_node_bw": 1.0 / inv,
                "ratio": out["intra"]["intra_node_bw"] * inv,
                "a2a_inter_latency": extra,
                "a2a_peer_latency": peer,
                "sizes": sizes,
                "rel_rms": float(np.sqrt(np.mean(((pred - y) / y) ** 2))),
            }
        out["inter"] = fits
        out["reading"] = min(fits, key=lambda k: fits[k]["rel_rms"])
    return out


# ----- 2. and 3. compute -------------------------------------------------------------------------------
def measure_token_work(cfg: ModelConfig, tokens: int, device, dtype, repeats: int) -> list[dict]:
    """Seconds of one layer's token-wise work (projections, router, experts), forward + backward,
    on 1 token and on `tokens` tokens (the difference is the per-token rate, the rest a fixed
    cost); its model FLOPs as the cost model counts them."""
    torch.manual_seed(0)
    # an attention block: its projections are the ones layer_params_active counts (a linear kind's
    # S layers have their own)
    at = [i for i, t in enumerate(cfg.layer_types) if t == "F" and i >= cfg.first_dense_layers]
    if not at:
        raise SettingError(
            f"model {cfg.name}: no attention layer with experts (every layer is linear attention, or dense); the calibration "
            f"measures an attention layer's token-wise work"
        )
    block = HybridMoE(cfg).blocks[at[0]]
    block = block.to(device=device, dtype=dtype)
    cost = CostModel(cfg, HardwareConfig())
    rows = []
    for n in sorted({1, tokens}):
        x = torch.randn(n, cfg.hidden, device=device, dtype=dtype, requires_grad=True)

        def step(x=x):
            q, k, v = block.project(block.attn_norm(x))
            z = block.wo(q[..., : cfg.v_dim].reshape(x.shape[0], -1))  # the queries in place of the attention's output
            m, _ = block.moe(block.moe_norm(z))
            (m.sum() + q.sum() + k.sum() + v.sum()).backward()

        rows.append(
            {"tokens": n, "seconds": timed(step, device, repeats), "flops": FWD_BWD_COMPUTE * FLOPS_PER_MAC * cost.layer_params_active * n}
        )
    return rows


def measure_layer_overhead(cfg: ModelConfig, backend: str, device, dtype, repeats: int) -> float:
    """Seconds of one whole layer (norms, projections, rotary, attention, experts), forward +
    backward, on a single token: its fixed cost, whatever the tokens."""
    from model import LocalPlacement  # noqa: PLC0415

    torch.manual_seed(0)
    model = HybridMoE(cfg).to(device=device, dtype=dtype)
    ctx = LocalPlacement([1], cfg, backend, device)
    x = torch.randn(1, cfg.hidden, device=device, dtype=dtype, requires_grad=True)

    def step():
        y, aux = model.blocks[1](x, ctx, cfg.layer_types[1], 1)
        (y.sum() + aux).backward()

    return timed(step, device, repeats)


# tokens per rank of the steps that measure how much of the experts' all-to-all is hidden: enough
# routed rows that the calls move bytes, few enough for a quick step
EXPERTS_STEP_TOKENS = 32


def measure_runtime_steps(
    cfg: ModelConfig,
    groups: ExchangeGroups,
    node: int,
    device,
    dtype,
    rounds: int,
    sizes: dict[str, int],
    tokens: int = STEP_SAMPLE_TOKENS,
) -> dict[str, list[float]]:
    """Seconds of the driver's whole step (model.distributed.run_step: FSDP2 over every rank, full
    recompute, the router's statistics summed over the world) on runtime_step_plan(size, tokens)
    for each named size (a name in HALO_STEPS: its halo plan), one sharded model for all: next to
    no work, so what a step takes is the runtime's fixed costs as the step pays them (layers,
    sharding and recompute hooks, collectives, and with size > 1 the exchanges' calls).
    REPLICATED_STEP: the "own" plan on replicated parameters, its gradients' all-reduce left out
    of its time: the same step without FSDP2's gathers and reductions (fit_grad_sync_overlap).
    Returns each plan's seconds, round by round (time_runtime_steps)."""
    world = dist.get_world_size()
    plans = {
        name: runtime_step_plan(world, node, size, tokens, name in HALO_STEPS, STEP_SAMPLES.get(name, 1)) for name, size in sizes.items()
    }
    return time_runtime_steps(cfg, plans, groups, device, dtype, rounds, replicated=frozenset({REPLICATED_STEP}))


# what each runtime step's time is fitted to (fit_fixed_cost), in order: each fit keeps the ones
# before (the halo step's full layers pay the all-to-all latency the node step fitted)
STEP_FITS = (("layer_overhead", "own"), ("a2a_latency", "node"), ("a2a_inter_latency", "wide"), ("halo_latency", "node-halo"))
HALO_STEPS = frozenset({"node-halo"})  # the runtime steps whose plan is a halo plan
# the runtime step of ranks alone with many short samples each (for a linear kind, every sample one
# block of the recurrence), paired with "own" (one sample a rank): what its extra samples took beyond
# their tokens' price is what a sample costs a rank in a step (fit_short_step_latency): a linear
# kind's blocks, where its mixer timed alone takes a third to a half of it; an attention kind's
# calls' per-sample loop, where the calls timed alone take a third to two fifths of it
SHORT_STEP, SHORT_STEP_SAMPLES = "own-short", 16
# the "own" plan on replicated parameters, timed without its gradients' all-reduce: what the own
# step took more is FSDP2's gathers and reductions as a step exposes them (fit_grad_sync_overlap)
REPLICATED_STEP = "own-replicated"
STEP_SAMPLES = {SHORT_STEP: SHORT_STEP_SAMPLES}  # samples per group of each runtime step (1 where absent)
# the runtime steps' rounds per median_of: the fixed costs are differences of steps, noisier than
# any one figure, and a round of a few steps on next to no tokens costs little
STEP_ROUNDS_PER_MEDIAN = 3


def fit_fixed_cost(
    step_s: float,
    cfg: ModelConfig,
    hw: HardwareConfig,
    world: int,
    node: int,
    field: str,
    size: int = 1,
    tokens: int = STEP_SAMPLE_TOKENS,
    halo: bool = False,
    overlap: float | None = None,
) -> float:
    """The value of the hardware setting `field` (a fixed cost the simulator charges linearly: a
    layer's seconds per pass, an all-to-all or halo call's latency) that makes the simulator's
    price of the runtime step on runtime_step_plan(size, tokens, halo) (as measure_runtime_steps
    runs it: full recompute, no optimizer, no experts' all-to-all) equal `step_s`: the price with
    it at 0, the rest over what one second of it adds. 0 if the price without it is already as long.
    `overlap`: the gathers' and reductions' hidden share (runtime_step_costs)."""
    from solver.simulator import simulate  # noqa: PLC0415

    plan = runtime_step_plan(world, node, size, tokens, halo)
    price = lambda v: simulate(plan, _step_cost(cfg, hw, field, v, overlap)).step_time  # noqa: E731
    return _solve_linear(step_s, price, f"the runtime step on groups of {size} ranks does not pay {field}: nothing to fit it to")


def runtime_step_costs(hw: HardwareConfig, overlap: float | None = None) -> CostsConfig:
    """The costs every mode pays as measure_runtime_steps' step pays them: full recompute, no
    optimizer, no experts' all-to-all, FSDP2 over every rank without expert parallelism, its
    parameters gathered in the runtime's element size (bf16 under CUDA's mixed precision, fp32 on
    a CPU: hw.bytes_per_element) and its gradients reduced in fp32; `overlap` the gathers' and
    reductions' hidden share (fit_grad_sync_overlap), or the costs' default."""
    hidden = {} if overlap is None else {"grad_sync_overlap": overlap}
    return CostsConfig(recompute="full", moe_all_to_all=False, optimizer=False, ep_degree=1, param_bytes=hw.bytes_per_element, **hidden)


def _step_cost(cfg: ModelConfig, hw: HardwareConfig, field: str, value: float, overlap: float | None = None) -> CostModel:
    """The cost model of a runtime step as measure_runtime_steps runs it (runtime_step_costs), with
    the hardware setting `field` at `value`."""
    hw = hw.replace(**{field: value})
    return CostModel(cfg, hw, costs=runtime_step_costs(hw, overlap))


def fit_grad_sync_overlap(exposed_s: float, cfg: ModelConfig, hw: HardwareConfig, world: int, node: int) -> float:
    """The share of FSDP2's gathers and reductions a step hides (the costs' grad_sync_overlap) from
    what they added to the own step (`exposed_s`: the "own" step less REPLICATED_STEP): what is
    left once their calls' latency is priced, over what their bytes take all exposed; in [0, 1]
    (1: they added no more than their calls' latency; 0: more than all their bytes' time)."""
    cost = CostModel(cfg, hw, node, costs=runtime_step_costs(hw, 0.0))
    latency = cost.grad_sync_volume(world)[2] * hw.collective_latency
    exposed_bytes = cost.grad_sync_time(world) - latency  # every byte exposed
    if exposed_bytes <= 0:
        raise ValueError(f"the runtime step on {world} ranks gathers and reduces nothing: no overlap to fit")
    return float(np.clip(1 - (exposed_s - latency) / exposed_bytes, 0.0, 1.0))


def _solve_linear(target: float, price, refusal: str) -> float:
    """The value v >= 0 of a cost that price(v) charges linearly at which price(v) equals
    `target`: the price with it at 0, the rest over what one second of it adds; 0 if the price
    without it is already as long. ValueError(refusal) where the cost moves no price."""
    without = price(0.0)
    per_second = price(1.0) - without
    if per_second <= 0:
        raise ValueError(refusal)
    return max(target - without, 0.0) / per_second


def short_step_field(cfg: ModelConfig) -> str:
    """The hardware setting the SHORT_STEP runtime step's extra samples fit: a linear kind's cost
    per block of its recurrence (each of its samples is one block), or else an attention call's
    cost per sample it holds (both the full and the sparse layers' calls loop over the samples)."""
    return sparse_cost(cfg.sparse_kind).per_sample_setting


def fit_short_step_latency(
    extra_s: float,
    cfg: ModelConfig,
    hw: HardwareConfig,
    world: int,
    node: int,
    tokens: int = STEP_SAMPLE_TOKENS,
    overlap: float | None = None,
) -> float:
    """The short_step_field(cfg) value that makes the simulator's price of the SHORT_STEP runtime
    step (ranks alone, SHORT_STEP_SAMPLES samples of `tokens` tokens each) exceed that of "own"
    (one such sample a rank) by `extra_s`, what the runtime's step took more: the same layers and
    calls, so what is left once the extra samples' token-wise work (and, for a linear kind, their
    attention in the full layers) is priced is their per-sample cost. 0 if the price without it
    already accounts for `extra_s`."""
    from solver.simulator import simulate  # noqa: PLC0415

    field = short_step_field(cfg)
    short, own = runtime_step_plan(world, node, 1, tokens, samples=SHORT_STEP_SAMPLES), runtime_step_plan(world, node, 1, tokens)

    def extra(v: float) -> float:
        cost = _step_cost(cfg, hw, field, v, overlap)
        return simulate(short, cost).step_time - simulate(own, cost).step_time

    return _solve_linear(extra_s, extra, f"{cfg.name}'s runtime steps do not pay {field} per sample: nothing to fit it to")


def keep_fit(hw: HardwareConfig, field: str, fitted: float) -> HardwareConfig:
    """The hardware with a fixed cost fitted to a runtime step: never below what the isolated
    measurement put there, but the halo call's (no lone halo call is measured: the halo step's fit
    is its latency). A cost kept at 0, the floor of the fit's range, is listed in `floored`, so
    the ablation says it prices that cost free on a bound, not a measurement."""
    kept = fitted if field == "halo_latency" else max(getattr(hw, field), fitted)
    floored = tuple(f for f in hw.floored if f != field) + ((field,) if kept == 0.0 else ())
    return hw.replace(**{field: kept, "floored": floored})


def fit_fixed_costs(
    rounds: dict[str, list[float]], cfg: ModelConfig, hw: HardwareConfig, world: int, node: int, sizes: dict[str, int], tokens: int
) -> tuple[HardwareConfig, dict[str, float], dict[str, list[float]]]:
    """The fixed costs of STEP_FITS from measure_runtime_steps' rounds; before them, where the
    rounds time REPLICATED_STEP, the gathers' and reductions' hidden share (fit_grad_sync_overlap:
    that round's "own" step less its REPLICATED_STEP), and where they time SHORT_STEP, the cost
    per sample (fit_short_step_latency: that round's SHORT_STEP less its "own" step; a linear
    kind's per block). Each round is fitted on its own, in that order, each
    fit keeping the ones before it from the same round (the wide step's call latency is what that
    round's wide step took beyond that round's layers and calls inside a node), and each cost's
    figure is the median of its rounds' fits, kept by keep_fit in order. A difference of two medians taken over
    separate spells of a shared machine is what made single fits swing between runs
    (docs/calibration.md); the rounds' median drops a spell that slowed one round. Returns the
    hardware, each cost's median fit (the hidden share under "grad_sync_overlap", a costs
    setting, not the hardware's), and its rounds' fits."""
    present = [(field, key) for field, key in STEP_FITS if key in rounds]
    pair = SHORT_STEP in rounds and "own" in rounds  # the per-sample cost first: the own step's one sample pays it too
    sharded = REPLICATED_STEP in rounds and "own" in rounds
    count = {len(rounds[key]) for _, key in present} | {len(rounds[k]) for k in (SHORT_STEP, REPLICATED_STEP) if k in rounds}
    if len(count) > 1:
        raise ValueError(f"the runtime steps were timed in unequal rounds ({sorted(count)}): each round times every step")
    short = short_step_field(cfg)
    each: dict[str, list[float]] = {"grad_sync_overlap": []} if sharded else {}
    each.update({short: []} if pair else {})
    each.update((field, []) for field, _ in present)
    for r in range(count.pop() if count else 0):
        h, overlap = hw, None
        if sharded:
            overlap = fit_grad_sync_overlap(rounds["own"][r] - rounds[REPLICATED_STEP][r], cfg, h, world, node)
            each["grad_sync_overlap"].append(overlap)
        if pair:
            v = fit_short_step_latency(rounds[SHORT_STEP][r] - rounds["own"][r], cfg, h, world, node, tokens, overlap)
            each[short].append(v)
            h = keep_fit(h, short, v)
        for field, key in present:
            v = fit_fixed_cost(rounds[key][r], cfg, h, world, node, field, sizes[key], tokens, key in HALO_STEPS, overlap)
            each[field].append(v)
            h = keep_fit(h, field, v)
    fitted = {field: float(np.median(v)) for field, v in each.items()}
    for field in fitted:  # in the order fitted
        if field != "grad_sync_overlap":
            hw = keep_fit(hw, field, fitted[field])
    return hw, fitted, each


def measure_attention(cfg: ModelConfig, lengths: list[int], backend: str, device, dtype, repeats: int) -> list[dict]:
    """Seconds of full and sparse attention (all heads), forward + backward, on packs of each
    length: one sample, or samples of ATTENTION_SHORT tokens (as many samples as the pack holds,
    next to no FLOPs); the FLOPs as the cost model counts them and the samples the call loops over
    (fit_attention separates the two). A linear kind has no sparse attention: its mixer is
    measure_linear's."""
    rows = []
    cost = CostModel(cfg, HardwareConfig())
    attention_of = ("full", cfg.sparse_kind) if cost.sparse.calibration == "attention" else ("full",)  # else its mixer: measure_linear
    for n in lengths:
        for samples in ([n], [ATTENTION_SHORT] * max(1, n // ATTENTION_SHORT)):
            m = sum(samples)
            q = torch.randn(m, cfg.n_heads, cfg.head_dim, device=device, dtype=dtype, requires_grad=True)
            kv = torch.randn(m, cfg.n_kv_heads, cfg.head_dim, device=device, dtype=dtype, requires_grad=True)
            cu = torch.tensor(np.concatenate([[0], np.cumsum(samples)]), dtype=torch.int32, device=device)
            lens = np.array(samples, dtype=np.float64)
            for kind in attention_of:
                params = None if kind == "full" else cfg.sparse_params

                def step(kind=kind, params=params, q=q, kv=kv, cu=cu, longest=samples[0]):  # the samples are of one length
                    varlen_attention(q, kv, kv, cu, longest, kind, params, backend).sum().backward()

                t = timed(step, device, repeats)
                fwd = np.sum(attention_flops(causal_keys(lens), cfg) if kind == "full" else cost.sparse.flops(lens, cfg))
                rows.append({"kind": kind, "length": m, "samples": len(samples), "seconds": t, "flops": FWD_BWD_COMPUTE * float(fwd)})
    return rows


ATTENTION_SHORT = 4  # tokens of each sample in measure_attention's packs of many samples


def measure_linear(cfg: ModelConfig, lengths: list[int], backend: str, device, dtype, repeats: int) -> list[dict]:
    """Seconds of a linear kind's mixer (model.linear.GatedDeltaNet.mix: the convolution, the gates
    and the chunked recurrence, what the cost model prices at the linear rate), forward +
    backward, on packs of each length: one sample, or samples of a quarter block (as many blocks,
    next to no FLOPs); with every head, and with one key head's (a Ulysses rank's share in a group
    as wide as the key heads). The FLOPs as the cost model counts them and the blocks the
    recurrence loops over (fit_linear separates the two)."""
    p = cfg.sparse_params
    short = max(1, p["block"] // 4)
    rows = []
    for k_heads in sorted({p["k_heads"], 1}, reverse=True):
        part = cfg.replace(sparse_params={**p, "k_heads": k_heads, "v_heads": p["v_heads"] * k_heads // p["k_heads"]})
        torch.manual_seed(0)
        mixer = HybridMoE(part).blocks[part.layer_types.index("S")].mixer.to(device=device, dtype=dtype)
        cost = CostModel(part, HardwareConfig())
        for n in lengths:
            for samples in ([n], [short] * max(1, n // short)):
                m = sum(samples)
                cu = np.concatenate([[0], np.cumsum(samples)]).tolist()
                mixed = torch.randn(m, mixer.channels, device=device, dtype=dtype, requires_grad=True)
                a, b = (torch.randn(m, mixer.hv, device=device, dtype=dtype, requires_grad=True) for _ in range(2))

                def step(mixer=mixer, mixed=mixed, a=a, b=b, cu=cu):
                    mixer.mix(mixed, a, b, cu, backend=backend)[0].sum().backward()

                lens = np.array(samples, dtype=np.float64)
                rows.append(
                    {
                        "kind": cfg.sparse_kind,
                        "length": m,
                        "samples": len(samples),
                        "v_heads": mixer.hv,
                        "blocks": int(np.ceil(lens / p["block"]).sum()),
                        "seconds": timed(step, device, repeats),
                        "flops": FWD_BWD_COMPUTE * float(cost.sparse.flops(lens, part).sum()),
                    }
                )
    return rows


def fit_linear(rows: list[dict], peak: float) -> dict:
    """seconds = fixed + FLOPs / (efficiency x peak) + blocks x block latency (measure_linear's
    rows: forward + backward): fit_per_item over the blocks the recurrence loops over."""
    return fit_per_item(rows, peak, "blocks", "block_latency")


def fit_attention(rows: list[dict], peak: float) -> dict:
    """seconds = fixed + FLOPs / (efficiency x peak) + samples x sample latency (measure_attention's
    rows: forward + backward): fit_per_item over the samples an attention call loops over."""
    return fit_per_item(rows, peak, "samples", "sample_latency")


def fit_per_item(rows: list[dict], peak: float, count: str, name: str) -> dict:
    """seconds = fixed + FLOPs / (efficiency x peak) + rows[count] x a latency per item, least
    squares on the relative residual; a part lost in noise (a negative fit) is refit without it.
    The latency (as `name`) is a forward's share (backward counts twice)."""
    f = np.array([r["flops"] for r in rows])
    items = np.array([r[count] for r in rows], dtype=np.float64)
    t = np.array([r["seconds"] for r in rows])
    (fixed, inv_rate, per_item), _ = _lstsq(np.stack([np.ones_like(f), f, items], 1), t)
    if per_item < 0:  # no loop to speak of: the FLOPs alone
        out = fit_efficiency(rows, peak)
        return {**out, name: 0.0}
    if inv_rate <= 0:  # the FLOPs' part lost in noise: the items alone, the rate at the peak
        (fixed, per_item), _ = _lstsq(np.stack([np.ones_like(f), items], 1), t)
        inv_rate = 1.0 / peak
    fixed = max(float(fixed), 0.0)
    errs = (fixed + f * inv_rate + items * per_item - t) / t
    return {
        "efficiency": float(min(1.0 / (inv_rate * peak), 1.0)),
        name: float(max(per_item, 0.0)) / FWD_BWD_COMPUTE,
        "fixed_s": fixed,
        "rel_rms": float(np.sqrt(np.mean(errs**2))),
        "worst_rel": float(np.max(np.abs(errs))),
    }


def measure_device(device, dtype) -> dict:
    """The device's matmul rate (a large square product) and copy bandwidth, on every rank at once."""
    n = 4096 if device.type == "cuda" else 768
    a = torch.randn(n, n, device=device, dtype=dtype)
    mm = timed(lambda: a @ a, device, 3)
    big = torch.empty(64 << 20 if device.type == "cuda" else 8 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(big)
    cp = timed(lambda: dst.copy_(big), device, 3)
    return {"matmul_flops": 2 * n**3 / mm, "copy_bytes_per_s": 2 * big.numel() / cp}


def bare_layer_overhead(layer_s: float, per_call: float) -> float:
    """A layer's fixed cost per forward from a bare S layer's forward and backward on one token
    (measure_layer_overhead): one forward's share, less what its mixer's one call is priced apart
    (`per_call`: attention_sample_latency for one sample, or linear_block_latency for one block)."""
    return max(layer_s / FWD_BWD_COMPUTE - per_call, 0.0)


def fit_efficiency(rows: list[dict], peak: float) -> dict:
    """seconds = fixed + FLOPs / (efficiency x peak), least squares over the rows (the fixed part is
    the layer overhead's, measured whole); each row's relative error of the time it predicts."""
    f = np.array([r["flops"] for r in rows])
    t = np.array([r["seconds"] for r in rows])
    (fixed, inv_rate), _ = _lstsq(np.stack([np.ones_like(f), f], 1), t)
    if inv_rate <= 0:  # the FLOP-dependent part is lost in noise: all of it at the largest size
        big = int(np.argmax(f))
        inv_rate = max(t[big] - max(fixed, 0.0), 1e-12) / f[big]
    fixed = max(float(fixed), 0.0)
    eff = 1.0 / (inv_rate * peak)
    errs = (fixed + f * inv_rate - t) / t
    return {
        "efficiency": float(min(eff, 1.0)),
        "fixed_s": fixed,
        "rel_rms": float(np.sqrt(np.mean(errs**2))),
        "worst_rel": float(np.max(np.abs(errs))),
    }


# ----- the whole calibration --------------------------------------------------------------------------
def calibrate(
    cfg: ModelConfig,
    node: int,
    tokens_per_rank: int,
    quick: bool = False,
    peak_flops: float | None = None,
    backend: str = "auto",
    median_of: int | None = None,
    step_tokens: int = STEP_SAMPLE_TOKENS,
    step_rounds: int | None = None,
) -> dict:
    """Measure and fit on the current process group; every rank returns the same profile.
    `median_of`: the timed runs each figure is the median of (default: the quick or full sizes');
    `step_tokens`: tokens per rank of the runtime steps that fit the fixed costs; `step_rounds`: the
    rounds they are timed in (default STEP_ROUNDS_PER_MEDIAN x median_of)."""
    world = dist.get_world_size()
    if world % node:
        raise SettingError(f"the world size {world} is not a multiple of --gpus-per-node={node}")
    device, dtype = step_device()
    sizes = QUICK if quick else FULL
    if median_of is not None:
        sizes = {**sizes, "median_of": median_of}
    groups = ExchangeGroups(world)
    groups.ensure_every_aligned_group()  # the calibration times every width
    backend = resolve_backend(backend, device, dtype)
    dev = measure_device(device, dtype)
    a2a = measure_all_to_all(groups, node, sizes["bytes"], cfg, device, dtype, sizes["median_of"])
    one = torch.zeros(1, device=device)
    collective = timed(lambda: dist.all_reduce(one, group=groups.get(0, world) if world > 1 else None), device, sizes["median_of"])
    tokens = sizes["tokens"] or tokens_per_rank
    work = measure_token_work(cfg, tokens, device, dtype, sizes["median_of"])
    attn = measure_attention(cfg, sizes["lengths"], backend, device, dtype, sizes["median_of"])
    linear = sparse_cost(cfg.sparse_kind).calibration == "mixer"  # its mixer fits its own rate (linear_efficiency) and per-block cost
    mixer = measure_linear(cfg, sizes["lengths"], backend, device, dtype, sizes["median_of"]) if linear else None
    layer = measure_layer_overhead(cfg, backend, device, dtype, sizes["median_of"])
    # the runtime's step on step_tokens per rank: every rank alone, in groups of a node (at most the heads allow), in groups of
    # the widest width the heads allow across nodes (where there is more than one node)
    widest = CostModel(cfg, HardwareConfig()).widest_group(Cluster(world, node, step_tokens))
    step_sizes = {"own": 1, "node": min(node, widest), "wide": widest, "node-halo": min(node, widest)}
    if widest <= node:
        del step_sizes["wide"]
    if step_sizes["node"] == 1:  # no group inside a node the heads allow: nothing pays a call's latency
        del step_sizes["node"], step_sizes["node-halo"]
    elif sparse_cost(cfg.sparse_kind).first_key is None:  # a kind without a reach runs no halo exchange
        del step_sizes["node-halo"]
    step_sizes[SHORT_STEP] = 1  # ranks alone with many short samples: a sample's cost as a step pays it (fit_short_step_latency)
    if world > 1:  # the own step without FSDP2's collectives: what they add to it (fit_grad_sync_overlap)
        step_sizes[REPLICATED_STEP] = 1
    rounds = step_rounds or STEP_ROUNDS_PER_MEDIAN * sizes["median_of"]
    runtime_rounds = measure_runtime_steps(cfg, groups, node, device, dtype, rounds, step_sizes, step_tokens)
    experts_a2a = measure_experts_all_to_all(groups, node, sizes["bytes"], cfg, device, dtype, sizes["median_of"])
    overlap = measure_experts_overlap(cfg, groups, node, device, dtype, sizes["median_of"], EXPERTS_STEP_TOKENS)
    peak = peak_flops or dev["matmul_flops"]
    net = fit_all_to_all(a2a, node)
    experts_net = fit_all_to_all(experts_a2a, node)
    gemm = fit_efficiency(work, peak)
    att = fit_attention(attn, peak)
    lin = fit_linear(mixer, peak) if linear else None
    base = HardwareConfig()
    reading = net.get("reading", base.ratio_reading)
    hw = base.replace(
        name=f"profile:{provenance()['device']}",
        peak_flops=peak,
        gemm_efficiency=gemm["efficiency"],
        attention_efficiency=att["efficiency"],
        attention_sample_latency=att["sample_latency"],
        linear_efficiency=lin["efficiency"] if lin else None,
        linear_block_latency=lin["block_latency"] if lin else 0.0,
        intra_node_bw=net["intra"]["intra_node_bw"],
        inter_intra_ratio=net["inter"][reading]["ratio"] if "inter" in net else base.inter_intra_ratio,
        ratio_reading=reading,
        a2a_latency=net["intra"]["a2a_latency"],
        a2a_inter_latency=net["inter"][reading]["a2a_inter_latency"] if "inter" in net else base.a2a_inter_latency,
        a2a_peer_latency=net["inter"][reading]["a2a_peer_latency"] if "inter" in net else base.a2a_peer_latency,
        experts_intra_bw=experts_net["intra"]["intra_node_bw"],
        experts_inter_bw=experts_net["inter"][reading]["inter_node_bw"] if "inter" in experts_net else None,
        bytes_per_element=torch.tensor([], dtype=dtype).element_size(),
        hbm_bw=dev["copy_bytes_per_s"] / 2,
        layer_overhead=bare_layer_overhead(layer, lin["block_latency"] if lin else att["sample_latency"]),
        collective_latency=collective,
    )
    # the runtime's own steps: its fixed costs as it pays them (a bare layer's forward and backward
    # leave out the sharding and recompute hooks; a lone all-to-all, the collectives and the
    # scheduling around it in a step); each never below what the isolated measurement says, but
    # the halo call's, which has none
    hw, from_step, from_rounds = fit_fixed_costs(runtime_rounds, cfg, hw, world, node, step_sizes, step_tokens)
    costs = {} if overlap["moe_overlap"] is None else {"moe_overlap": overlap["moe_overlap"]}
    # FSDP2's gathers in the runtime's element size, and the share of them and the reductions a step hides
    costs["param_bytes"] = hw.bytes_per_element
    if "grad_sync_overlap" in from_step:
        costs["grad_sync_overlap"] = from_step["grad_sync_overlap"]
    return {
        "hardware": hw.to_dict(),
        "costs": costs,  # what the calibration measured of the costs every mode pays (--costs profile.json)
        "provenance": {**provenance(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
        "world_size": world,
        "gpus_per_node": node,
        "model": cfg.name,
        "attention_backend": backend,
        "fits": {
            "all_to_all": net,
            "experts_all_to_all": experts_net,
            "token_work": gemm,
            "attention": att,
            **({"linear": lin} if lin else {}),
            "inter_measured": "inter" in net,
        },
        "measurements": {
            "device": dev,
            "all_to_all": a2a,
            "experts_all_to_all": experts_a2a,
            "experts_overlap": overlap,
            "collective_s": collective,
            "layer_1_token_s": layer,
            # by plan: "own" (groups of 1), "node", "wide", "node-halo" (groups of a node, halo sparse layers)
            "runtime_step_s": {k: float(np.median(v)) for k, v in runtime_rounds.items()},  # each plan's median
            "runtime_step_rounds_s": runtime_rounds,  # each plan's seconds, round by round (every plan once a round)
            "runtime_step_sizes": step_sizes,
            "runtime_step_tokens": step_tokens,  # per rank
            "from_runtime_step": from_step,  # each fixed cost's fit to its step: the median of its rounds' fits
            "from_runtime_step_rounds": from_rounds,  # each fixed cost's fit in each round
            "token_work": work,
            "attention": attn,
            **({"linear": mixer} if linear else {}),
        },
    }


def _spread(rounds: dict, field: str, scale: float = 1e3, unit: str = "") -> str:
    """' (median of N rounds, quartiles a-b)' of a fit's rounds (x scale: ms by default), or ''."""
    if not rounds.get(field):
        return ""
    lo, hi = scale * np.percentile(rounds[field], [25, 75])
    return f" (median of {len(rounds[field])} rounds, quartiles {lo:.2f}-{hi:.2f}{unit})"


def report(profile: dict) -> str:
    hw, fits = profile["hardware"], profile["fits"]
    net = fits["all_to_all"]
    lines = [
        f"hardware profile: {profile['world_size']} ranks in nodes of {profile['gpus_per_node']}, {profile['provenance']['device']}, "
        f"commit {profile['provenance']['commit']}",
        f"  all-to-all inside a node: {hw['intra_node_bw'] / 1e9:.3f} GB/s per rank, latency {1e6 * net['intra']['a2a_latency']:.0f} us "
        f"(rel. RMS residual {100 * net['intra']['rel_rms']:.1f}%, {net['intra']['points']} points)",
    ]
    if "inter" in net:
        for name, f in net["inter"].items():
            kept = " <- kept" if name == net["reading"] else ""
            peer = ""  # a profile from before the per-peer latency says nothing of it
            if len(f.get("sizes", ())) > 1:
                peer = f", +{1e6 * f['a2a_peer_latency']:.0f} us per peer past the first (groups of {f['sizes']})"
            elif "sizes" in f:
                peer = f", per peer not told apart (groups of {f['sizes']} only)"
            lines.append(
                f"  across nodes, {name} reading: {f['inter_node_bw'] / 1e9:.3f} GB/s, ratio {f['ratio']:.2f}x, "
                f"+{1e6 * f['a2a_inter_latency']:.0f} us per call{peer} (rel. RMS residual {100 * f['rel_rms']:.1f}%){kept}"
            )
    else:
        lines.append(f"  across nodes: not measured (one node); ratio kept at {hw['inter_intra_ratio']} ({hw['ratio_reading']} reading)")
    for key, label in (("token_work", "token-wise work"), ("attention", "attention"), ("linear", f"{profile['model']}'s linear mixer")):
        if key not in fits:  # the linear mixer's, where the model has a linear kind
            continue
        f = fits[key]
        loop = ""  # what each iteration of the mixer's loop costs, where the fit has it
        if "block_latency" in f:
            loop = f", {1e3 * f['block_latency']:.3f} ms per block of its recurrence and forward pass"
        if "sample_latency" in f:
            loop = f", {1e3 * f['sample_latency']:.3f} ms per sample of a call and forward pass (attention_sample_latency)"
        lines.append(
            f"  {label}: {100 * f['efficiency']:.1f}% of the peak {hw['peak_flops'] / 1e12:.3f} TFLOP/s{loop} "
            f"(rel. RMS residual {100 * f['rel_rms']:.1f}%, worst {100 * f['worst_rel']:.1f}%)"
        )
    m = profile["measurements"]
    crossing = net["inter"][net["reading"]]["a2a_inter_latency"] if "inter" in net else 0.0
    # the S layers' cost per call of their loop, as the isolated fit has it and as the short step fits it
    short, one_call, what, alone_label = (
        ("linear_block_latency", fits["linear"]["block_latency"], "per recurrence block", "the mixer alone")
        if "linear" in fits
        else ("attention_sample_latency", fits["attention"]["sample_latency"], "per sample of an attention call", "the calls alone")
    )
    isolated = {  # field: (what it is, what the isolated measurement says)
        "layer_overhead": (
            "per layer and forward pass; a bare layer on one token",
            bare_layer_overhead(m["layer_1_token_s"], one_call),
        ),
        "a2a_latency": ("per all-to-all call; a lone call", net["intra"]["a2a_latency"]),
        "a2a_inter_latency": ("more per call across nodes; a lone call", crossing),
        "halo_latency": ("per halo call (kept as fitted); a lone all-to-all call", net["intra"]["a2a_latency"]),
    }
    lines.append(
        f"  fixed costs, fitted to the runtime's step on {m['runtime_step_tokens']} tokens per rank (kept where above the isolated, "
        "the halo call's as fitted):"
    )
    rounds = m.get("from_runtime_step_rounds", {})
    for field, key in STEP_FITS:
        if field in m["from_runtime_step"]:
            label, alone = isolated[field]
            lines.append(
                f"    groups of {m['runtime_step_sizes'][key]}{', halo sparse layers' if key in HALO_STEPS else ''}: "
                f"{1e3 * m['runtime_step_s'][key]:.1f} ms -> "
                f"{1e3 * m['from_runtime_step'][field]:.2f} ms{_spread(rounds, field)} {label}: {1e3 * alone:.2f} ms; "
                f"kept {1e3 * hw[field]:.2f} ms"
            )
    if short in m["from_runtime_step"]:  # the per-call cost's fit, where the rounds timed the short-sample step
        extra = m["runtime_step_s"][SHORT_STEP] - m["runtime_step_s"]["own"]
        lines.append(
            f"    ranks alone, {SHORT_STEP_SAMPLES} samples a rank against one: {1e3 * extra:.1f} ms more -> "
            f"{1e3 * m['from_runtime_step'][short]:.3f} ms {what}{_spread(rounds, short)}; "
            f"{alone_label}: {1e3 * one_call:.3f} ms; kept {1e3 * hw[short]:.3f} ms"
        )
    if "grad_sync_overlap" in m["from_runtime_step"]:  # the hidden share's fit, where the rounds timed the replicated step
        extra = m["runtime_step_s"]["own"] - m["runtime_step_s"][REPLICATED_STEP]
        grad_bytes = CostsConfig().grad_bytes  # runtime_step_costs keeps the default
        lines.append(
            f"    ranks alone, FSDP2 against replicated parameters: {1e3 * extra:.1f} ms more -> its gathers and reductions "
            f"{100 * m['from_runtime_step']['grad_sync_overlap']:.0f}% hidden{_spread(rounds, 'grad_sync_overlap', 100, '%')} "
            f"(parameters gathered in {profile['costs']['param_bytes']} bytes, gradients reduced in {grad_bytes})"
        )
    for field in hw.get("floored", ()):
        lines.append(f"    {field} fitted at the floor of its range (0): the step took no longer than its price without it; priced free")
    if "a2a_inter_latency" not in m["from_runtime_step"]:
        lines.append("    no step across nodes: one node, or too few heads for a group across two")
    if "halo_latency" not in m["from_runtime_step"]:
        lines.append("    no halo step: no group inside a node the heads allow, or a sparse kind without a reach")
    ex = fits["experts_all_to_all"]
    across = f", {hw['experts_inter_bw'] / 1e9:.3f} GB/s across nodes" if hw.get("experts_inter_bw") else ""
    lines.append(
        f"  the experts' all-to-all: {hw['experts_intra_bw'] / 1e9:.3f} GB/s per rank inside a node{across} "
        f"(rel. RMS residual {100 * ex['intra']['rel_rms']:.1f}%)"
    )
    ov = m["experts_overlap"]
    if ov["moe_overlap"] is None:
        lines.append("  the experts' all-to-all hidden behind compute: not measured (no expert parallelism on these nodes)")
    else:
        lines.append(
            f"  the experts' all-to-all hidden behind compute: {100 * ov['moe_overlap']:.0f}% (EP{ov['ep_degree']} step "
            f"{1e3 * ov['step_ep_s']:.1f} ms, without {1e3 * ov['step_s']:.1f} ms, its calls {1e3 * ov['all_to_all_s']:.1f} ms)"
        )
    lines.append(f"  {1e3 * hw['collective_latency']:.2f} ms per collective of the world")
    lines.append(f"  memory bandwidth {hw['hbm_bw'] / 1e9:.1f} GB/s, {hw['bytes_per_element']} bytes per element")
    return "\n".join(lines)
