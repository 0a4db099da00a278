"""The estimate of a parent's time, written out slowly and readably: the definition the solvers' fast
paths re-type for speed (PlanEstimate.parent_time and parent_times, the parent solver's joint fill
_BinFill, the rebalance's trial moves _GroupState.price, the child solver's ChildProblem.child_time),
and that tests/test_reference.py checks each of them against on random instances.

It reads only the cost model's per-sample costs (CostModel.full_cost, linear_cost) and its
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

from collections.abc import Mapping

import numpy as np

from .cost import CostModel, rank_time
from .layout import Group, TokenLayout, chunk_bounds, halo_pair_rows, state_hops
from .plan import ParentPlan


def shared_time(parent: Group, length_of: Mapping[int, int], cost: CostModel) -> float:
    """Seconds every rank of `parent` spends on its full attention and its full layers' exchange latencies."""
    full_attention = sum(float(cost.full_cost(length_of[s])) for s in parent.samples) / parent.size
    latencies = cost.model.n_full * cost.layer_exchange_time(0.0, parent.start, parent.size, parent.start)
    return full_attention + latencies


def halo_rows(group: Group, length_of: Mapping[int, int], cost: CostModel) -> np.ndarray:
    """Halo rows each rank of `group` receives per sparse layer when it runs as a halo child."""
    rows = np.zeros(group.size)
    if group.size == 1:
        return rows
    layout = TokenLayout((group,), {s: length_of[s] for s in group.samples})
    for (_, dst), n in halo_pair_rows(layout, group, cost.sparse.check_local(), cost.model.sparse_params).items():
        rows[dst - group.start] += n
    return rows


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


def state_time(group: Group, length_of: Mapping[int, int], cost: CostModel, chain: bool) -> float:
    """Seconds of one linear layer's state passing in a halo child (every pass), at its worst
    rank: every earlier map to each later chunk (chain=False, CostModel.state_layer_time), or
    the chain (chain_path, every exchange pass); and forming the maps, every attention pass."""
    maps, seconds = state_load(group, length_of, cost)
    if not chain:
        across = group.spans_nodes(cost.gpus_per_node)
        return max((cost.state_layer_time(m, t, across) for m, t in zip(maps, seconds)), default=0.0)
    return cost.exchange_passes * sum(chain_path(group, length_of, cost)) + cost.attention_passes * float(seconds.max(initial=0.0))


def child_time(child: Group, parent: Group, length_of: Mapping[int, int], cost: CostModel) -> float:
    """Seconds a rank of `child` (inside `parent`; the parent itself when it is not repacked) spends
    on everything that runs in the child layout, with its tokens split evenly over the child. A
    halo child (Group.halo): its even share of the work and of the parent's full-layer exchanges
    per token, and its worst rank's halo exchanges (CostModel.halo_line)."""
    if child.halo:
        lin = sum(float(cost.linear_cost(length_of[s])) for s in child.samples)
        tokens = sum(length_of[s] for s in child.samples)
        rows = float(halo_rows(child, length_of, cost).max(initial=0.0))
        across = child.spans_nodes(cost.gpus_per_node)
        a, b = cost.halo_line(parent.size, rows, across)
        if cost.sparse.passing is not None:  # a linear kind: its states too, the way the child passes them
            b += cost.model.n_sparse * state_time(child, length_of, cost, child.chain)
        return rank_time(lin, tokens, child.size, (a, b))
    m = cost.model
    tokens_per_rank = sum(length_of[s] for s in child.samples) / child.size
    work = sum(float(cost.linear_cost(length_of[s])) for s in child.samples) / child.size
    rank = child.start
    sparse_exchanges = m.n_sparse * cost.layer_exchange_time(tokens_per_rank, child.start, child.size, rank, "S")
    full_bytes = cost.layer_exchange_time(tokens_per_rank, parent.start, parent.size, rank) - cost.layer_exchange_time(
        0.0, parent.start, parent.size, rank
    )
    return work + sparse_exchanges + m.n_full * full_bytes


def parent_time(parent: ParentPlan, length_of: Mapping[int, int], cost: CostModel) -> float:
    """Seconds of one parent plan (any children, Ulysses or halo): its shared part plus its slowest
    child's (0 for an empty parent). The one definition: the halo stages price candidates with it."""
    g = parent.group
    if not g.samples:
        return 0.0
    return shared_time(g, length_of, cost) + max(child_time(c, g, length_of, cost) for c in parent.children)


def best_layout_time(group: Group, children: tuple[Group, ...], length_of: Mapping[int, int], cost: CostModel) -> float:
    """Seconds of a wide parent that takes the faster of its children and its own layout (what the
    child solver decides, and the rebalance's trial moves price)."""
    own = ParentPlan(group, (group,), "its own layout")
    return min(parent_time(own, length_of, cost), parent_time(ParentPlan(group, children), length_of, cost))
