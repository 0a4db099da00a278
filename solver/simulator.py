"""Step-time simulator: per-rank timelines of one training step under a StepPlan.

The embedded default engine of the ablation. For every layer, forward then backward:
token-wise work on each rank's tokens of the current token layout; full attention between the
parent's entry and exit exchanges; sparse attention between the child's own exchanges (none for
a child of one rank); each layer's experts' all-to-all (the part not hidden behind compute).
With activation recompute the backward of a layer first re-runs its forward (exchanges
included; selective recompute: attention only). Every all-to-all is a synchronization point of
its group: it starts when the group's last rank arrives and lasts as long as its slowest
member's transfers (intra-node and inter-node phases added, a conservative no-overlap model; a
group across nodes under the "group" ratio reading moves all its bytes at the cross-node rate).
With CostsConfig.overlap_blocks > 1 (a priced what-if) an attention's exchanges are pipelined in
head blocks with it (solver.timeline.Timeline.pipelined_exchange).
The step ends at the slowest rank, then every rank pays the exposed gradient sync and the
optimizer step. A layer's fixed cost (HardwareConfig.layer_overhead, measured by the
calibration) is paid by every rank in every pass. The sequence itself is solver.timeline's, which
the solvers' step estimate (PlanEstimate.step_time) runs over children instead of ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from config import SettingError

from .cluster import ceil_pow2
from .cost import CostModel
from .layout import Way, halo_pair_rows, rank_tokens, relayout_rows, state_hops, state_pair_maps
from .plan import StepPlan
from .reference import chain_path, state_load
from .sites import Family, Site
from .timeline import Groups, Phases, run_step


@dataclass
class StepResult:
    step_time: float  # seconds
    mfu: float  # model FLOPs with causal full attention (ours)
    mfu_noncausal: float  # the older convention: full attention counts all L^2 pairs
    model_flops: float
    lower_bound: float  # seconds: perfect balance, no inter-node traffic in sparse layers
    compute: float  # mean over ranks, seconds (these seven parts add up to step_time)
    intra_comm: float  # Ulysses exchanges inside a node (and every exchange's latency)
    inter_comm: float  # Ulysses exchanges across nodes
    moe_comm: float  # the experts' dispatch and combine all-to-all (the part not hidden) and the router's all-reduces
    grad_sync: float  # gradient reduce-scatter and parameter all-gather, the part not hidden
    optimizer: float
    imbalance_wait: float
    full_intra_bytes: float  # whole step, all ranks: bytes that stay inside a node at full layers
    full_inter_bytes: float
    sparse_intra_bytes: float
    sparse_inter_bytes: float
    moe_intra_bytes: float  # the experts' all-to-alls, whole step, all ranks: the expectation under uniform routing
    moe_inter_bytes: float
    redist_intra_bytes: float  # a redistribute plan's hidden-state all-to-alls at full/sparse boundaries (in full_* too)
    redist_inter_bytes: float
    a2a_calls_full: int  # all-to-all calls per rank at full-attention sites (max over ranks)
    a2a_calls_sparse: int
    # mean over ranks, seconds from arriving at a site's all-to-alls to their end, the wait for the
    # group included: what a timer around the calls measures (train --timers); they overlap the
    # parts above (comm and imbalance wait), they do not add to them
    full_exchange: float
    sparse_exchange: float
    moe_exchange: float  # the experts' all-to-all calls (their exposed time, every pass)

    def to_dict(self):
        return asdict(self)


class _Layout(Groups):
    """Contiguous groups of one token layout as arrays over ranks."""

    def __init__(self, groups, world: int, lengths, cost: CostModel):
        groups = sorted(groups, key=lambda g: g.start)
        super().__init__(np.array([g.start for g in groups]), np.array([g.size for g in groups]))
        self.size_of_rank = np.repeat(self.sizes, self.sizes)
        self.start_of_rank = np.repeat(self.starts, self.sizes)
        counts = np.fromiter((len(g.samples) for g in groups), dtype=np.int64, count=len(groups))
        of = np.repeat(np.arange(len(groups)), counts)
        n = np.fromiter((lengths[s] for g in groups for s in g.samples), dtype=np.int64, count=int(counts.sum()))
        tokens = rank_tokens(groups, lengths, world, n)  # the lengths just gathered
        lens = n.astype(np.float64)
        halo = np.array([g.halo for g in groups], dtype=bool)
        full_attn = np.bincount(of, cost.full_attn_time(lens), len(groups)) / self.sizes
        # a linear kind's blocks: each rank of a Ulysses group loops over every block of its samples
        # (the heads split, not the blocks); a halo group's ranks over their chunks' (about 1/size each)
        blocks = np.bincount(of, cost.block_time(lens), len(groups)) / np.where(halo, self.sizes, 1)
        sparse_attn = np.bincount(of, cost.sparse_attn_time(lens), len(groups)) / self.sizes + blocks
        self.tokens = tokens  # tokens each rank holds in this token layout
        self.full_attn = np.repeat(full_attn, self.sizes)  # forward seconds per rank in head layout
        self.sparse_attn = np.repeat(sparse_attn, self.sizes)
        # an attention call's cost per sample: a Ulysses group's ranks hold every sample (their
        # heads), a halo group's their pieces; the S layers' as their kind prices its calls
        lat, lat_s = cost.hw.attention_sample_latency, cost.sparse_sample_latency
        calls = np.repeat(counts, self.sizes).astype(np.float64) if lat or lat_s else None
        if lat:
            self.full_attn = self.full_attn + lat * calls
        if lat_s:
            if halo.any():
                calls = np.where(np.repeat(halo, self.sizes), rank_tokens(groups, lengths, world, n, pieces=True), calls)
            self.sparse_attn = self.sparse_attn + lat_s * calls


def _exchange(cost: CostModel, layout: _Layout, send_rows: np.ndarray, recv_rows: np.ndarray, row_bytes: np.ndarray, g: int):
    """Per-rank (intra seconds, inter seconds, intra bytes sent, inter bytes sent) of one all-to-all.

    send_rows[r]: rows r sends to each peer; recv_rows[r]: rows r receives in all (from all peers,
    its own block included). Each row carries row_bytes[r] / size bytes to one peer."""
    size = layout.size_of_rank.astype(np.float64)
    world = len(size)
    ranks = np.arange(world)
    node = ranks // g
    lo = np.maximum(layout.start_of_rank, node * g)
    hi = np.minimum(layout.start_of_rank + layout.size_of_rank, (node + 1) * g)
    same = (hi - lo).astype(np.float64)  # group members on my node, me included
    per_peer = row_bytes / size
    send_intra = send_rows * per_peer * (same - 1)
    send_inter = send_rows * per_peer * (size - same)
    # received: the rows of same-node peers (minus mine) and of the other nodes' peers
    node_rows = np.zeros(world)
    for k in range(len(layout.starts)):
        a, s = layout.starts[k], layout.sizes[k]
        rows = send_rows[a : a + s]
        for n0 in range(a // g, (a + s - 1) // g + 1):
            lo_n, hi_n = max(a, n0 * g), min(a + s, (n0 + 1) * g)
            node_rows[lo_n:hi_n] = rows[lo_n - a : hi_n - a].sum()
    recv_intra = (node_rows - send_rows) * per_peer
    recv_inter = (recv_rows - node_rows) * per_peer
    spans = size > same  # a call across nodes pays the network's round trip
    group_rate = spans if cost.hw.ratio_reading == "group" else None  # a group across nodes: all its bytes at the cross-node rate
    latency = cost.hw.a2a_call_latency(size)  # per rank, its group's call
    return _priced(cost, send_intra, send_inter, recv_intra, recv_inter, size > 1, spans, group_rate, latency)


def _priced(cost: CostModel, send_intra, send_inter, recv_intra, recv_inter, calls, across, group_rate, call_latency):
    """Per-rank (intra seconds, inter seconds, intra bytes sent, inter bytes sent) of one exchange
    from each rank's bytes by tier: calls[r], r pays `call_latency` (seconds, or seconds per
    rank); across[r], what crossing nodes adds; group_rate[r] (or None), all r's bytes at the
    cross-node rate. Otherwise each tier's bytes at its rate, the larger of what a rank sends and
    receives."""
    hw = cost.hw
    latency = np.where(calls, call_latency, 0.0)
    extra = np.where(across, hw.a2a_inter_latency, 0.0)
    intra_s = np.maximum(send_intra, recv_intra) / hw.intra_node_bw + latency
    inter_s = np.maximum(send_inter, recv_inter) / hw.inter_node_bw + extra
    if group_rate is not None:
        whole = np.maximum(send_intra + send_inter, recv_intra + recv_inter) / hw.inter_node_bw + extra
        intra_s = np.where(group_rate, latency, intra_s)
        inter_s = np.where(group_rate, whole, inter_s)
    return intra_s, inter_s, send_intra, send_inter


def _pairs_exchange(cost: CostModel, pairs: dict, world: int, g: int, callers: np.ndarray, group_rate: np.ndarray | None, call_latency):
    """Per-rank (intra seconds, inter seconds, intra bytes sent, inter bytes sent) of one exchange
    given by its bytes per (source, destination): a redistribution's all-to-all or a halo's
    point-to-point sends. callers[r]: rank r takes part (pays `call_latency`, and what crossing
    nodes adds when any of its peers is on another node); group_rate[r] (an all-to-all's group
    spans nodes under the group reading): all r's bytes at the cross-node rate. Otherwise each
    byte goes at its link's rate, the tiers one after the other."""
    send = np.zeros((world, 2))
    recv = np.zeros((world, 2))
    for (src, dst), b in pairs.items():
        tier = 0 if src // g == dst // g else 1
        send[src, tier] += b
        recv[dst, tier] += b
    across = callers & ((send[:, 1] + recv[:, 1]) > 0)
    return _priced(cost, send[:, 0], send[:, 1], recv[:, 0], recv[:, 1], callers, across, group_rate, call_latency)


def halo_exchange(plan: StepPlan, cost: CostModel):
    """One sparse layer's key/value halo exchange (forward) of every halo child of `plan`, as
    _pairs_exchange; None when the plan has none. Point-to-point: each byte at its link's rate, a
    halo call's latency (HardwareConfig.halo_call_latency) per rank that takes part."""
    halos = [c for p in plan.parents for c in p.children if c.halo and c.size > 1]
    if not halos:
        return None
    first_key = cost.sparse.check_local()
    world, g = plan.cluster.world_size, plan.cluster.gpus_per_node
    row = cost.halo_row_bytes()
    pairs: dict = {}
    callers = np.zeros(world, dtype=bool)
    for c in halos:
        callers[c.start : c.stop] = True
        for key, rows in halo_pair_rows(plan.child_layout, c, first_key, cost.model.sparse_params).items():
            pairs[key] = pairs.get(key, 0.0) + rows * row
    rows_x = _pairs_exchange(cost, pairs, world, g, callers, None, cost.hw.halo_call_latency)
    if not cost.state_bytes():  # a kind that passes no state (attention) makes no second call
        return rows_x
    maps: dict = {}  # the maps of the children passing their states in one round: a second point-to-point call
    gathering = callers.copy()
    for c in halos:
        if c.way is Way.CHAIN:
            gathering[c.start : c.stop] = False
            continue
        for key, n in state_pair_maps(plan.child_layout, c).items():
            maps[key] = maps.get(key, 0.0) + n * cost.state_bytes()
    maps_x = _pairs_exchange(cost, maps, world, g, gathering, None, cost.hw.halo_call_latency)
    return tuple(a + b + c for a, b, c in zip(rows_x, maps_x, _chains(plan, cost, halos)))


def _chains(plan: StepPlan, cost: CostModel, halos) -> tuple[np.ndarray, ...]:
    """Per rank (intra seconds, inter seconds, intra bytes sent, inter bytes sent) of one pass of
    the chain-passing halo children's states: every rank of such a child waits the child's
    longest path of hops (solver.reference.chain_path) and sends its own hops' states."""
    world, g = plan.cluster.world_size, plan.cluster.gpus_per_node
    out = tuple(np.zeros(world) for _ in range(4))
    for c in (c for c in halos if c.way is Way.CHAIN):
        intra, inter = chain_path(c, plan.length_of, cost)
        out[0][c.start : c.stop] += intra
        out[1][c.start : c.stop] += inter
        for t in state_hops(plan.child_layout, c):
            out[2 if t.src // g == t.dst // g else 3][t.src] += cost.carried_bytes()
    return out


def map_seconds(plan: StepPlan, cost: CostModel) -> np.ndarray:
    """Per rank, forward seconds of the maps its chunks form in a linear kind's halo children (a
    chunk whose sample goes on to a later rank's chunk; solver.reference.state_load)."""
    out = np.zeros(plan.cluster.world_size)
    if not cost.state_bytes():  # a kind that passes no state forms no maps: the loop over its chunks skipped
        return out
    for c in (c for p in plan.parents for c in p.children if c.halo and c.size > 1):
        out[c.start : c.stop] += state_load(c, plan.length_of, cost)[1]
    return out


def redistributions(plan: StepPlan, cost: CostModel):
    """The hidden states' all-to-alls at the full/sparse boundaries of a plan's redistributing
    parents (ParentPlan.redistributed), each over its group, as _pairs_exchange (a group across nodes under the group
    reading at the cross-node rate): (child layout -> parent layout before a full layer, the way
    back after it, whose bytes per pair are the first's transposed)."""
    world, g = plan.cluster.world_size, plan.cluster.gpus_per_node
    row = cost.hidden_row_bytes()
    pairs: dict = {}
    callers = np.zeros(world, dtype=bool)
    spans = np.zeros(world, dtype=bool)
    size = np.zeros(world)
    for p in plan.parents:
        if not p.redistributed:
            continue
        grp = p.group
        callers[grp.start : grp.stop] = True
        spans[grp.start : grp.stop] = grp.spans_nodes(g)
        size[grp.start : grp.stop] = grp.size
        for key, rows in relayout_rows(plan.child_layout, plan.parent_layout, grp).items():
            if key[0] != key[1]:
                pairs[key] = pairs.get(key, 0.0) + rows * row
    reading = spans if cost.hw.ratio_reading == "group" else None
    back = {(dst, src): b for (src, dst), b in pairs.items()}
    lat = cost.hw.a2a_call_latency(size)  # an all-to-all's call over the parent
    return _pairs_exchange(cost, pairs, world, g, callers, reading, lat), _pairs_exchange(cost, back, world, g, callers, reading, lat)


def lower_bound(plan: StepPlan, cost: CostModel) -> float:
    """Perfect balance of all compute, no inter-node traffic in sparse layers, and each sample's
    full-attention exchanges priced at its memory-floor width (no plan can do less)."""
    cost = cost.for_cluster(plan.cluster)
    lens = np.array([n for _, n in plan.lengths], dtype=np.float64)
    compute = float(cost.sample_cost(lens).sum())
    xfull = 0.0
    for n in lens:
        m = min(ceil_pow2(n / plan.cluster.tokens_per_rank), plan.cluster.world_size)
        if m > 1:
            xfull += cost.model.n_full * cost.exchange_line(m)[0] * n  # rank-seconds: n/m tokens per rank on m ranks
    world = plan.cluster.world_size
    return (compute + xfull) / world + cost.moe_fixed_time() + cost.grad_sync_time(world) + cost.optimizer_time(world)


def _layer_exchanges(cost: CostModel, layout: _Layout, rows: np.ndarray, g: int, layer_type: str):
    """(entry, exit) Ulysses exchanges of one layer of `layer_type` over the groups of `layout`, each
    rank sending its `rows`, each as _exchange. The exit's byte matrix is the entry's transpose,
    so with per-rank max(send, receive) it has the entry's shape at the exit's row size."""
    world = len(rows)
    group_tokens = np.repeat(np.add.reduceat(rows, layout.starts), layout.sizes)
    entry = np.array([cost.entry_row_bytes(int(s), layer_type) for s in layout.size_of_rank])
    exit_ = np.full(world, cost.exit_row_bytes(layer_type))
    return _exchange(cost, layout, rows, group_tokens, entry, g), _exchange(cost, layout, rows, group_tokens, exit_, g)


def _sparse_exchanges(plan: StepPlan, cost: CostModel, child: _Layout):
    """(entry, exit) of one sparse layer's exchanges, per rank as _exchange: a Ulysses child's
    heads, a halo child's keys and values at the entry (nothing at its exit)."""
    world, g = plan.cluster.world_size, plan.cluster.gpus_per_node
    entry, exit_ = _layer_exchanges(cost, child, child.tokens, g, "S")
    halo = halo_exchange(plan, cost)
    if halo is None:
        return entry, exit_
    on = np.zeros(world, dtype=bool)
    for c in (c for p in plan.parents for c in p.children if c.halo):
        on[c.start : c.stop] = True
    return tuple(np.where(on, h, u) for h, u in zip(halo, entry)), tuple(np.where(on, 0.0, u) for u in exit_)


def sparse_layer_bytes(plan: StepPlan, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """Per rank, the bytes it sends in one sparse layer's forward as the simulator prices it (a
    Ulysses child's entry and exit all-to-alls, a halo child's keys and values): (in all, of
    which to other nodes)."""
    cost = cost.for_cluster(plan.cluster)
    child = _Layout(plan.child_layout.groups, plan.cluster.world_size, plan.length_of, cost)
    (_, _, e_intra, e_inter), (_, _, x_intra, x_inter) = _sparse_exchanges(plan, cost, child)
    return e_intra + e_inter + x_intra + x_inter, e_inter + x_inter


def simulate(plan: StepPlan, cost: CostModel) -> StepResult:
    """Simulate one training step (forward + backward) of `plan`.

    >>> from config import Cluster, HardwareConfig, ModelConfig
    >>> from solver import CostModel, make_plan, samples_from_lengths
    >>> cost = CostModel(ModelConfig.from_name("paper"), HardwareConfig())
    >>> r = simulate(make_plan(samples_from_lengths([100_000] + [4000] * 40), Cluster(16, 8, 32768), cost, "repack"), cost)
    >>> 0 < r.mfu < 1
    True
    """
    cost = cost.for_cluster(plan.cluster)
    world, g = plan.cluster.world_size, plan.cluster.gpus_per_node
    m = cost.model
    if world % cost.ep_degree:
        raise SettingError(
            f"costs.ep_degree (--ep)={cost.ep_degree} does not divide the cluster's {world} ranks: the runtime's expert-parallel "
            f"groups tile the world"
        )
    parent = _Layout(plan.parent_layout.groups, world, plan.length_of, cost)
    child = _Layout(plan.child_layout.groups, world, plan.length_of, cost)
    child.sparse_attn = child.sparse_attn + map_seconds(plan, cost)  # a linear kind's halo children form their chunks' maps
    # token-wise work runs in the child layout (== parent in baseline); a redistributing parent's
    # full layers run theirs in the parent layout, between the two redistributions (ParentPlan.redistributed)
    moved = np.zeros(world, dtype=bool)
    for p in plan.parents:
        if p.redistributed:
            moved[p.group.start : p.group.stop] = True
    tokens = {"S": child.tokens, "F": np.where(moved, parent.tokens, child.tokens)}
    phases = Phases(
        ranks=world,
        parent=parent,
        child=child,
        tokens=tokens,
        full_attn=parent.full_attn,
        sparse_attn=child.sparse_attn,
        full_x=_layer_exchanges(cost, parent, tokens["F"], g, "F"),
        sparse_x=_sparse_exchanges(plan, cost, child),
        redist=redistributions(plan, cost) if plan.redistributes else None,
    )
    if cost.costs.overlap_blocks > 1:  # one head block's exchanges: the same calls, each row's bytes / blocks
        block = cost.head_block()
        phases.full_xb = _layer_exchanges(block, parent, tokens["F"], g, "F")
        phases.sparse_xb = _sparse_exchanges(plan, block, child)
    tl, bytes_acc, calls = run_step(phases, cost)
    moe_bytes = cost.moe_token_bytes()
    kinds = m.layer_types
    slowest = float(tl.t.max())
    tl.wait += slowest - tl.t
    grad_sync, optimizer = cost.grad_sync_time(world), cost.optimizer_time(world)  # every rank, after the slowest
    step = slowest + grad_sync + optimizer
    lengths = [n for _, n in plan.lengths]
    flops = cost.model_flops(lengths)
    return StepResult(
        step_time=step,
        mfu=flops / (step * world * cost.hw.peak_flops),
        mfu_noncausal=cost.model_flops(lengths, causal=False) / (step * world * cost.hw.peak_flops),
        model_flops=flops,
        lower_bound=lower_bound(plan, cost),
        compute=float(tl.compute.mean()),
        intra_comm=float(tl.intra.mean()),
        inter_comm=float(tl.inter.mean()),
        moe_comm=float(tl.moe.mean()),
        grad_sync=grad_sync,
        optimizer=optimizer,
        imbalance_wait=float(tl.wait.mean()),
        full_intra_bytes=bytes_acc[Family.FULL][0],
        full_inter_bytes=bytes_acc[Family.FULL][1],
        sparse_intra_bytes=bytes_acc[Family.SPARSE][0],
        sparse_inter_bytes=bytes_acc[Family.SPARSE][1],
        moe_intra_bytes=float(sum(tokens[k].sum() for k in kinds)) * moe_bytes[0],
        moe_inter_bytes=float(sum(tokens[k].sum() for k in kinds)) * moe_bytes[1],
        redist_intra_bytes=bytes_acc[Site.FULL_REDIST][0],
        redist_inter_bytes=bytes_acc[Site.FULL_REDIST][1],
        a2a_calls_full=calls[Family.FULL],
        a2a_calls_sparse=calls[Family.SPARSE],
        full_exchange=float(tl.blocked[Family.FULL].mean()),
        sparse_exchange=float(tl.blocked[Family.SPARSE].mean()),
        moe_exchange=float(tl.blocked[Family.EXPERTS].mean()),
    )
