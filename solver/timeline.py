"""The step's sequence, shared by the simulator and the solvers' step estimate: every layer
forward, the LM head, every layer backward (recomputed first under full recompute), each layer's
token-wise work around its exchanges, its attention between them, its experts' all-to-all and the
router's world barrier, over *units*: the simulator's are ranks (solver.simulator), the
estimate's are children, each standing for its ranks (solver.estimate.PlanEstimate.step_time).
Both fill in Phases (what each unit holds and what each exchange costs it) and run the same ops
(run_step for the simulator, with where the time went; stretch_ends, the clock alone, for the
estimate), so the estimate prices the step the simulator charges, barriers and all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost import BWD_COMPUTE, FWD_BWD_COMPUTE, FWD_COMPUTE, CostModel
from .kinds import attention_token_split
from .sites import Family, Site

# all-reduces of the router's statistics per MoE layer (model.layers.MoE): the token counts and
# the probability mass forward; the mass's gradient backward
ROUTER_FWD_COLLECTIVES, ROUTER_BWD_COLLECTIVES = 2, 1


class Groups:
    """Contiguous groups of units (starts, sizes), each synchronized by its exchanges."""

    def __init__(self, starts: np.ndarray, sizes: np.ndarray):
        self.starts, self.sizes = np.asarray(starts), np.asarray(sizes)
        self.singles = len(self.sizes) == 0 or int(self.sizes.max()) == 1  # then a group's max is its unit's own value

    def group_max(self, x: np.ndarray) -> np.ndarray:
        if self.singles:
            return x
        return np.repeat(np.maximum.reduceat(x, self.starts), self.sizes)


class Timeline:
    """Per unit (a rank, or a child standing for its ranks): the clock and where its time went."""

    def __init__(self, world: int, accounts: bool = True):
        self.t = np.zeros(world)
        self.accounts = accounts  # False: the clock alone (the estimate needs no breakdown)
        self.compute = np.zeros(world)
        self.intra = np.zeros(world)
        self.inter = np.zeros(world)
        self.wait = np.zeros(world)
        self.moe = np.zeros(world)
        self.blocked = {f: np.zeros(world) for f in Family}  # seconds each unit waits on each family's exchanges

    def work(self, dt: np.ndarray):
        self.t += dt
        if self.accounts:
            self.compute += dt

    def moe_exchange(self, dt: np.ndarray):
        self.t += dt
        if self.accounts:
            self.moe += dt
            self.blocked[Family.EXPERTS] += dt

    def world_barrier(self, dt: float):
        """A collective of every rank (the router's statistics): all wait for the slowest, then dt."""
        top = self.t.max()
        if not self.accounts:
            self.t[:] = top + dt
            return
        self.wait += top - self.t
        self.t[:] = top + dt
        self.moe += dt

    def sync_exchange(self, layout: Groups, intra_s: np.ndarray, inter_s: np.ndarray, site: str):
        """All-to-all over each group of `layout`: wait for the group, then its slowest transfer."""
        if not self.accounts:
            self.t = layout.group_max(self.t) + layout.group_max(intra_s + inter_s)
            return
        start = layout.group_max(self.t)
        self.wait += start - self.t
        dur, crit_intra = _slowest(layout, intra_s, inter_s)
        self.blocked[site] += start - self.t + dur
        # attribute the blocked time like the group's critical member splits it
        frac_intra = np.divide(crit_intra, dur, out=np.zeros_like(dur), where=dur > 0)
        self.intra += dur * frac_intra
        self.inter += dur * (1 - frac_intra)
        self.t = start + dur

    def pipelined_exchange(self, layout: Groups, first: tuple, attn: np.ndarray, last: tuple, blocks: int, site: str):
        """An attention between two exchanges of its group, pipelined in `blocks` head blocks
        (CostsConfig.overlap_blocks). `first` and `last`: (intra, inter) seconds per unit of one
        block's exchange; `attn`: each unit's attention (all blocks). The schedule: the group
        starts together; the first exchange's blocks run back to back; a block's attention starts
        once its first exchange is in and the previous block's attention is done; the last
        exchange's blocks follow the first's, each once every unit's attention of that block is
        done (a collective of the group). With f, l the group's slowest block exchanges and a its
        slowest attention, that schedule lasts
            max(f + a + l, k (f + l), k f + a/k + l, f + a/k + k l),
        (a block's attention ends at max(f + i a/k, i f + a/k), each term linear in the block i,
        so the last exchange's end is set by the first or the last block); k = 1 is the
        unpipelined f + a + l. The exposed exchange is that less a."""
        k = blocks
        start = layout.group_max(self.t)
        f, f_intra = _slowest(layout, *first)
        last_b, l_intra = _slowest(layout, *last)
        a = layout.group_max(attn)
        span = np.maximum(np.maximum(f + a + last_b, k * (f + last_b)), np.maximum(k * f + a / k + last_b, f + a / k + k * last_b))
        if self.accounts:
            self.wait += start - self.t + a - attn
            self.compute += attn
            self.blocked[site] += start - self.t + span - attn
            exposed = span - a
            both = f + last_b
            frac_intra = np.divide(f_intra + l_intra, both, out=np.zeros_like(both), where=both > 0)
            self.intra += exposed * frac_intra
            self.inter += exposed * (1 - frac_intra)
        self.t = start + span


def _slowest(layout: Groups, intra_s: np.ndarray, inter_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per unit, its group's slowest transfer (intra + inter seconds) and that transfer's intra part."""
    own = intra_s + inter_s
    dur = layout.group_max(own)
    crit_intra = layout.group_max(np.where(own == dur, intra_s, -np.inf))
    return dur, np.where(np.isfinite(crit_intra), crit_intra, 0.0)


@dataclass
class Phases:
    """What one step's units hold and pay, per unit (arrays over units): a unit's ranks each hold
    `tokens` (per layer type, 'F' and 'S') and pay `full_attn` and `sparse_attn` forward seconds;
    an exchange is (intra seconds, inter seconds, intra bytes sent, inter bytes sent) per unit;
    `parent` and `child` group the units as the full and the sparse layers' exchanges synchronize
    them. `ranks`: the cluster's ranks (the router's barrier needs more than one). Where the
    attention's exchanges are pipelined (CostsConfig.overlap_blocks > 1), `full_xb` and `sparse_xb`
    are one head block's (entry, exit), as the whole exchanges (CostModel.head_block)."""

    ranks: int
    parent: Groups
    child: Groups
    tokens: dict
    full_attn: np.ndarray
    sparse_attn: np.ndarray
    full_x: tuple  # (entry, exit) of one full layer
    sparse_x: tuple  # (entry, exit) of one sparse layer
    redist: tuple | None  # (to the parent layout, back) of a redistributing plan's full layers
    full_xb: tuple | None = None  # (entry, exit) of one head block of a full layer's exchanges
    sparse_xb: tuple | None = None  # and of a sparse layer's


def run_step(ph: Phases, cost: CostModel) -> tuple[Timeline, dict, dict]:
    """The step's timeline over the units of `ph` (up to the slowest unit; the gradient sync and
    the optimizer come after), with where each unit's time went: the timeline, bytes sent per
    site ([intra, inter]) and calls per site. The clock alone, cut at the barriers: stretch_ends."""
    tl, run, ops, bytes_acc, calls, _ = _program(ph, cost, accounts=True)
    for op in ops:
        run(op)
    return tl, bytes_acc, calls


def stretch_ends(ph: Phases, cost: CostModel) -> tuple[list[tuple[int, float]], np.ndarray]:
    """The step's clock cut where the router's barrier synchronizes every unit: (the sequence of
    stretches, each (its kind's index, the barrier's seconds after it); per kind of stretch, the
    latest end over each parent group (`ph.parent`) [kinds, parents], each stretch started at
    zero). Units of different parents never meet but at the barrier (a child lies inside its
    parent), so a parent's ends depend on its units alone, and the step's end is step_end of the
    sequence and, per kind, the latest end over every parent: PlanEstimate prices a plan from
    the ends of its parents, each computed once. Without the barrier (router_sync off, one rank)
    the whole step is one stretch."""
    tl, run, ops, _, _, router = _program(ph, cost, accounts=False)
    sequence, ends = _stretches(tl, run, ops, router, cost)
    starts = np.asarray(ph.parent.starts)
    return sequence, np.array([np.maximum.reduceat(e, starts) for e in ends]).reshape(len(ends), len(starts))


def step_end(sequence: list[tuple[int, float]], latest: list[float]) -> float:
    """The clock at the step's end: each stretch's latest end (`latest`, per kind) and the barrier
    after it, summed in the step's order."""
    total = 0.0
    for kind, barrier in sequence:
        total += latest[kind] + barrier
    return total


def _stretches(tl: Timeline, run, ops: list[tuple], router: bool, cost: CostModel) -> tuple[list[tuple[int, float]], list[np.ndarray]]:
    """The clock alone, cut at the router's barriers: every unit leaves a barrier at the same time,
    so a stretch between two barriers lasts what it lasts from zero, and alike stretches (the same
    layer types and passes) are run once. Returns the sequence of stretches (kind, the barrier's
    seconds after it) and each kind's end per unit."""
    units = len(tl.t)
    if not router:  # no barrier: one stretch, the whole step
        tl.t = np.zeros(units)
        for op in ops:
            run(op)
        return [(0, 0.0)], [tl.t.copy()]
    sequence, kinds, ends, body = [], {}, [], []
    for op in [*ops, ("sync", 0)]:
        if op[0] != "sync":
            body.append(op)
            continue
        key = tuple(body)
        if key not in kinds:
            tl.t = np.zeros(units)
            for o in key:
                run(o)
            kinds[key] = len(ends)
            ends.append(tl.t.copy())
        sequence.append((kinds[key], op[1] * cost.hw.collective_latency))
        body = []
    return sequence, ends


def _program(ph: Phases, cost: CostModel, accounts: bool):
    """The step's ops in order, and what runs them on a fresh timeline over the units of `ph`:
    (the timeline, run(op), the ops, bytes per site, calls per site, whether the router's barrier
    synchronizes every unit at every MoE layer)."""
    m = cost.model
    units = len(ph.full_attn)
    tokens, parent, child = ph.tokens, ph.parent, ph.child
    # each layer's token-wise work around its exchanges: an F layer's q, k, v projections before
    # its entry, the output projection and the experts after; an S layer's as its kind splits it
    split = {"F": attention_token_split(cost), "S": cost.sparse.token_split(cost)}
    t_pre = {k: t * split[k][0] * split[k][1] for k, t in tokens.items()}
    t_post = {k: t * split[k][0] * split[k][2] for k, t in tokens.items()}
    t_head = tokens["S"] * cost.head_token_time
    full_x, sparse_x, redist = ph.full_x, ph.sparse_x, ph.redist

    tl = Timeline(units, accounts)
    # bytes (intra, inter) by family, and by a redistributing parent's own site (both its ways; its
    # bytes are its full layers' too); calls by family
    bytes_acc = {Family.FULL: [0.0, 0.0], Family.SPARSE: [0.0, 0.0], Site.FULL_REDIST: [0.0, 0.0]}
    calls = {Family.FULL: 0, Family.SPARSE: 0}
    blocks = cost.costs.overlap_blocks
    if blocks > 1 and (ph.full_xb is None or ph.sparse_xb is None):
        raise ValueError(f"costs.overlap_blocks={blocks} pipelines the exchanges, and these Phases carry no head block's exchanges")

    def count(val, key, redistribution=False, n=1):
        """An exchange's bytes (in all, of every block) and its calls."""
        for site in ((key, Site.FULL_REDIST) if redistribution else (key,)) if accounts else ():  # a redistribution is a full layer's
            bytes_acc[site][0] += float(np.sum(val[2]))
            bytes_acc[site][1] += float(np.sum(val[3]))
        calls[key] += n

    def exchange(layout, val, key, redistribution=False):
        tl.sync_exchange(layout, val[0], val[1], key)  # zero for groups of one rank
        count(val, key, redistribution)

    def attention_layer(kind: str, factor: float):
        """One layer's forward (factor FWD_COMPUTE) or backward (BWD_COMPUTE, in reverse order)."""
        layout, attn, (entry, exit_), per_block = (
            (parent, ph.full_attn, full_x, ph.full_xb) if kind == "F" else (child, ph.sparse_attn, sparse_x, ph.sparse_xb)
        )
        # forward: pre -> entry -> attention -> exit -> post ; backward mirrors it. A redistribute
        # plan's full layer starts and ends with its redistributions (its MoE's all-to-all, priced
        # after the layer, runs before the second: the same calls, bytes and group waits). Pipelined
        # (overlap_blocks > 1): entry, attention and exit in head blocks, one op
        if blocks == 1:
            order = [("work", t_pre[kind]), ("x", entry), ("work", attn), ("x", exit_), ("work", t_post[kind])]
        else:
            order = [("work", t_pre[kind]), ("piped", ((entry, per_block[0]), attn, (exit_, per_block[1]))), ("work", t_post[kind])]
        if kind == "F" and redist is not None:
            order = [("redist", redist[0]), *order, ("redist", redist[1])]
        if factor != FWD_COMPUTE:
            order = order[::-1]
        key = Family.FULL if kind == "F" else Family.SPARSE
        tl.work(np.full(units, cost.hw.layer_overhead * factor))  # the layer's fixed cost, every rank
        for op, val in order:
            if op == "work":
                tl.work(val * factor)
            elif op == "x":
                exchange(layout, val, key)
            elif op == "piped":  # backward: the exit's exchange first
                first, att, last = val if factor == FWD_COMPUTE else val[::-1]
                tl.pipelined_exchange(layout, first[1][:2], att * factor, last[1][:2], blocks, key)
                count(first[0], key, n=blocks)
                count(last[0], key, n=blocks)
            else:
                exchange(parent, val, Family.FULL, redistribution=True)

    # a layer's exposed expert all-to-alls, every pass, each rank's from its own tokens (their
    # expectation under uniform routing) and the calls' latencies; the router's world barrier
    # right after synchronizes every rank at every MoE layer, the EP groups with them
    moe = {k: t * cost.moe_token_time + cost.moe_layer_fixed() for k, t in tokens.items()}
    recompute = cost.costs.recompute
    kinds = m.layer_types
    router = cost.costs.router_sync and ph.ranks > 1

    # the step in order: a layer's pass ("layer", kind, factor), its experts' all-to-all ("moe",
    # kind), the LM head ("head",), selective recompute's attention ("again", kind), the router's
    # all-reduces ("sync", how many)
    ops: list[tuple] = []
    for kind in kinds:
        ops += [("layer", kind, FWD_COMPUTE), ("moe", kind), ("sync", ROUTER_FWD_COLLECTIVES)]
    ops.append(("head",))  # LM head forward + backward
    for kind in reversed(kinds):
        if recompute == "full":  # the layer's forward again, exchanges and router statistics included
            ops += [("layer", kind, FWD_COMPUTE), ("sync", ROUTER_FWD_COLLECTIVES)]
        elif recompute == "selective":  # attention again, from saved inputs in its layout
            ops.append(("again", kind))
        ops += [("sync", ROUTER_BWD_COLLECTIVES), ("layer", kind, BWD_COMPUTE)]  # the MoE's backward before its attention's

    def run(op: tuple) -> None:
        if op[0] == "layer":
            attention_layer(op[1], op[2])
        elif op[0] == "moe":
            tl.moe_exchange(moe[op[1]])
        elif op[0] == "head":
            tl.work(t_head * FWD_BWD_COMPUTE)
        elif op[0] == "again":
            tl.work(ph.full_attn if op[1] == "F" else ph.sparse_attn)
        elif router:  # the MoE layer's all-reduces of its router statistics over the world (CostsConfig.router_sync)
            tl.world_barrier(op[1] * cost.hw.collective_latency)

    return tl, run, ops, bytes_acc, calls, router
