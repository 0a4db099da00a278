"""Hypothesis strategies shared by the solver and kernel tests. They draw valid inputs by
construction: every batch they give can be placed."""

import os

from hypothesis import strategies as st

from config import Cluster
from solver import samples_from_lengths

ODD = [1, 2, 63, 97, 123]

# REPACK_EXPLORE=1 makes the costliest property tests explore further (the fast loop and CI keep
# them small; the local hypothesis profile draws fresh examples every run either way)
EXPLORE = bool(os.environ.get("REPACK_EXPLORE"))
# exact-MILP instances the child-solver test solves
MILP_INSTANCES = 40 if EXPLORE else 10
# examples of the tests that run Triton's interpreter on every rank of a plan (~1 s each)
INTERPRETED_EXAMPLES = 25 if EXPLORE else 8


# the widest group the tests' models split: tiny has 8 query and 8 key/value heads
TINY_WIDEST = 8


def fits_memory_floors(lengths, cluster: Cluster, widest: int = TINY_WIDEST) -> bool:
    """Do the samples' memory floors (cluster.min_group_size) fit the cluster's ranks, each within
    the widest group the model splits? Aligned power-of-two groups laid out widest first always
    fit when their sizes add up to at most the world, so this is exactly when the parent assignment's
    anchors can be placed."""
    floors = [cluster.min_group_size(n) for n in lengths if n > cluster.tokens_per_rank]
    return sum(floors) <= cluster.world_size and all(f <= widest for f in floors)


@st.composite
def clusters(draw, max_nodes=8, node_sizes=(1, 2, 4, 8)):
    g = draw(st.sampled_from(node_sizes))
    nodes = draw(st.integers(1, max_nodes))
    budget = draw(st.sampled_from([64, 97, 128, 256]))
    return Cluster(world_size=g * nodes, gpus_per_node=g, tokens_per_rank=budget)


@st.composite
def batches(draw, cluster: Cluster, fill=0.6, widest: int = TINY_WIDEST):
    """Lengths (with 1-token and odd sizes) whose total stays within `fill` of the capacity and
    whose memory floors fit (fits_memory_floors)."""
    cap = int(cluster.world_size * cluster.tokens_per_rank * fill)
    longest = min(min(cluster.widest_group, widest) * cluster.tokens_per_rank // 2, cap)
    lengths, total = [], 0
    n = draw(st.integers(1, 40))
    for _ in range(n):
        ln = draw(st.one_of(st.sampled_from(ODD), st.integers(1, max(1, longest))))
        if total + ln > cap or not fits_memory_floors(lengths + [ln], cluster, widest):
            break
        lengths.append(ln)
        total += ln
    if not lengths:
        lengths = [1]
    return samples_from_lengths(lengths)
