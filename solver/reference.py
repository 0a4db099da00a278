"""The estimate of a parent's time, written out slowly and readably: the definition the solvers' fast
paths re-type for speed (PlanEstimate.parent_time and parent_times, the parent solver's joint fill
_BinFill, the rebalance's trial moves _GroupState.price, the child solver's ChildProblem.child_time),
and that tests/test_reference.py checks each of them against on random instances.

It reads only the cost model's per-sample costs (CostModel.full_cost, tokenwise_cost) and its
exchange timeline (CostModel.layer_exchange_time, what the simulator charges a rank), at the
groups' real positions: none of the cached cost lines the fast paths use.

A parent's time is what its slowest rank spends on the work the layout decides:
- every rank of the parent does 1/P of each of its samples' full attention (all passes), and
  waits for its full layers' exchange calls (their latency);
- each child's ranks split the child's samples evenly: their token-wise and sparse-attention
  work, their own exchanges at every sparse layer, and their share of the parent's exchanges at
  every full layer (bytes per token: the rank's rows go to the parent's peers);
the parent's time is the shared part plus its slowest child's. The step's estimate is its slowest
parent's time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from .cost import CostModel, rank_time
from .layout import Group, TokenLayout, Way, chunk_bounds, halo_pair_rows, state_hops, state_pair_maps
from .plan import ParentPlan


def per_sample(costs, ids: Sequence[int], length_of: Mapping[int, int]) -> list[float]:
    """A per-sample cost (CostModel.full_cost, tokenwise_cost) of each of these samples, in order: one
    call over their lengths (each the float a call on that length alone gives)."""
    return costs(np.array([length_of[s] for s in ids], dtype=np.int64)).tolist()


def shared_time(parent: Group, length_of: Mapping[int, int], cost: CostModel) -> float:
    """Seconds every rank of `parent` spends on its full attention and its full layers' exchange latencies."""
    full_attention = sum(per_sample(cost.full_cost, parent.samples, length_of)) / parent.size
    latencies = cost.model.n_full * cost.layer_exchange_time(0.0, parent.start, parent.size, parent.start)
    return full_attention + latencies


def state_load(group: Group, length_of: Mapping[int, int], cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """Per rank of `group` run as a linear kind's halo child: the maps it sends or receives per
    layer, whichever is more, and the forward seconds of the maps its chunks form."""
    maps_in, maps_out, seconds = np.zeros(group.size), np.zeros(group.size), np.zeros(group.size)
    if group.size == 1:
        return maps_in, seconds
    for sid in group.samples:  # counted per sample, as solver.layout.state_transfers lists them (a test ties the two)
        b = chunk_bounds(length_of[sid], group.size)
        held = np.nonzero(b[1:] > b[:-1])[0]  # the ranks holding a non-empty chunk, in order
        before = np.arange(len(held))
        maps_in[held] += before  # each chunk receives the map of every earlier chunk
        maps_out[held] += len(held) - 1 - before  # and sends its own to every later one
        forming = held[:-1]  # every chunk but the last forms its map
        seconds[forming] += cost.map_time(b[forming + 1] - b[forming])
    return np.maximum(maps_in, maps_out), seconds


def chain_path(group: Group, length_of: Mapping[int, int], cost: CostModel) -> tuple[float, float]:
    """(intra, inter) seconds of one pass of a chain-passing group's states (state_hops): a rank
    sends its outgoing states once it holds its incoming ones, so the pass lasts its longest path
    of hops, each a point-to-point call (a halo call's latency, and what crossing nodes adds)
    carrying its states (CostModel.carried_bytes each) at its link's rate."""
    layout = TokenLayout((group,), {s: length_of[s] for s in group.samples})
    hops: dict[tuple[int, int], int] = {}
    for t in state_hops(layout, group):
        hops[(t.src, t.dst)] = hops.get((t.src, t.dst), 0) + 1
    hw, g = cost.hw, cost.gpus_per_node
    done = {r: (0.0, 0.0) for r in group.ranks}  # (intra, inter) seconds of the longest path ending at each rank
    for (src, dst), n in sorted(hops.items(), key=lambda kv: (kv[0][1], kv[0][0])):  # destinations in rank order
        across = src // g != dst // g
        hop = (
            hw.halo_call_latency
            + (hw.a2a_inter_latency if across else 0.0)
            + n * cost.carried_bytes() / (hw.inter_node_bw if across else hw.intra_node_bw)
        )
        via = (done[src][0], done[src][1] + hop) if across else (done[src][0] + hop, done[src][1])
        if sum(via) > sum(done[dst]):
            done[dst] = via
    return max(done.values(), key=sum)


def pairs_seconds(pairs: Mapping[tuple[int, int], float], group: Group, cost: CostModel) -> np.ndarray:
    """Per rank of `group`, seconds of one point-to-point exchange of `pairs` (bytes per (source,
    destination)) in which every rank of the group takes part: a halo call's latency, what
    crossing nodes adds where any of its bytes cross, and each tier's bytes (the more of what it
    sends and receives) at that tier's rate, one tier after the other."""
    hw, g = cost.hw, cost.gpus_per_node
    sent, got = np.zeros((group.size, 2)), np.zeros((group.size, 2))
    for (src, dst), b in pairs.items():
        tier = int(src // g != dst // g)
        sent[src - group.start, tier] += b
        got[dst - group.start, tier] += b
    most = np.maximum(sent, got)
    crossing = np.where(most[:, 1] > 0, hw.a2a_inter_latency, 0.0)
    return hw.halo_call_latency + most[:, 0] / hw.intra_node_bw + most[:, 1] / hw.inter_node_bw + crossing


def halo_seconds(group: Group, length_of: Mapping[int, int], cost: CostModel) -> np.ndarray:
    """Per rank of a halo child, seconds of one pass of one sparse layer's exchanges: its keys and
    values (halo_pair_rows), and a linear kind's states the way the child passes them (Group.way:
    by the chain, its longest path of hops, chain_path, which every rank of the child waits; else
    every earlier map to each later chunk in one round, a second call)."""
    if group.size == 1:
        return np.zeros(1)
    layout = TokenLayout((group,), {s: length_of[s] for s in group.samples})
    row = cost.halo_row_bytes()
    rows = {k: n * row for k, n in halo_pair_rows(layout, group, cost.sparse.check_local(), cost.model.sparse_params).items()}
    seconds = pairs_seconds(rows, group, cost)
    if group.way is Way.CHAIN:
        return seconds + sum(chain_path(group, length_of, cost))
    if not cost.state_bytes():  # a kind that passes no state (attention) makes no second call
        return seconds
    maps = {k: n * cost.state_bytes() for k, n in state_pair_maps(layout, group).items()}
    return seconds + pairs_seconds(maps, group, cost)


def halo_pass(group: Group, length_of: Mapping[int, int], cost: CostModel) -> float:
    """halo_seconds at the child's slowest rank: a pass lasts until its last rank is done."""
    return float(halo_seconds(group, length_of, cost).max())


def child_time(child: Group, parent: Group, length_of: Mapping[int, int], cost: CostModel) -> float:
    """Seconds a rank of `child` (inside `parent`; the parent itself when it is not repacked) spends
    on everything that runs in the child layout, with its tokens split evenly over the child. A
    halo child (Group.halo): its even share of the work and of the parent's full-layer exchanges
    per token, its slowest rank's halo exchanges every pass (halo_pass) and the maps its slowest
    rank forms every attention pass (CostModel.halo_line)."""
    if child.halo:
        tw = sum(per_sample(cost.tokenwise_cost, child.samples, length_of))
        tokens = sum(length_of[s] for s in child.samples)
        # the maps its slowest rank forms (a kind that passes no state forms none: the loop skipped)
        maps = float(state_load(child, length_of, cost)[1].max(initial=0.0)) if cost.state_bytes() else 0.0
        return rank_time(tw, tokens, child.size, cost.halo_line(parent.size, halo_pass(child, length_of, cost), maps))
    m = cost.model
    tokens_per_rank = sum(length_of[s] for s in child.samples) / child.size
    work = sum(per_sample(cost.tokenwise_cost, child.samples, length_of)) / child.size
    rank = child.start
    sparse_exchanges = m.n_sparse * cost.layer_exchange_time(tokens_per_rank, child.start, child.size, rank, "S")
    full_bytes = cost.layer_exchange_time(tokens_per_rank, parent.start, parent.size, rank) - cost.layer_exchange_time(
        0.0, parent.start, parent.size, rank
    )
    return work + sparse_exchanges + m.n_full * full_bytes


def parent_time(parent: ParentPlan, length_of: Mapping[int, int], cost: CostModel, below: float = math.inf) -> float:
    """Seconds of one parent plan (any children, Ulysses or halo): its shared part plus its slowest
    child's (0 for an empty parent). The one definition: the halo stages price candidates with it.

    below: a caller that only needs a time under `below` (a candidate against the best so far):
    once the children priced so far bring the parent to `below` or more, that time is returned,
    a lower bound of the full one and at least `below`. Halo children are priced first, then the
    widest (they are the likely slowest); the slowest is the same in any order."""
    g = parent.group
    if not g.samples:
        return 0.0
    shared = shared_time(g, length_of, cost)
    children = parent.children if below == math.inf else sorted(parent.children, key=lambda c: (not c.halo, -c.size))
    slowest = -math.inf
    for c in children:
        slowest = max(slowest, child_time(c, g, length_of, cost))
        if shared + slowest >= below:
            break
    return shared + slowest


def best_layout_time(group: Group, children: tuple[Group, ...], length_of: Mapping[int, int], cost: CostModel) -> float:
    """Seconds of a wide parent that takes the faster of its children and its own layout (what the
    child solver decides, and the rebalance's trial moves price)."""
    own = ParentPlan(group, (group,), "its own layout")
    return min(parent_time(own, length_of, cost), parent_time(ParentPlan(group, children), length_of, cost))
