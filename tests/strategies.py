"""Hypothesis strategies shared by the solver and kernel tests. They draw valid inputs by
construction: every batch they give can be placed."""

import os

from hypothesis import strategies as st

from solver import Cluster, samples_from_lengths

ODD = [1, 2, 63, 97, 123]

CI = bool(os.environ.get("CI"))
# exact-MILP instances the child-solver test solves: a few in CI, more locally
MILP_INSTANCES = 10 if CI else 40
# examples of the tests that run Triton's interpreter on every rank of a plan (~1 s each)
INTERPRETED_EXAMPLES = 12 if CI else 25


def fits_memory_floors(lengths, cluster: Cluster) -> bool:
    """Do the samples' memory floors (cluster.min_group_size) fit the cluster's ranks? Aligned
    power-of-two groups laid out widest first always fit when their sizes add up to at most the
    world, so this is exactly when the baseline's anchors can be placed."""
    return sum(cluster.min_group_size(n) for n in lengths if n > cluster.tokens_per_rank) <= cluster.world_size


@st.composite
def clusters(draw, max_nodes=8, node_sizes=(1, 2, 4, 8)):
    g = draw(st.sampled_from(node_sizes))
    nodes = draw(st.integers(1, max_nodes))
    budget = draw(st.sampled_from([64, 97, 128, 256]))
    return Cluster(world_size=g * nodes, gpus_per_node=g, tokens_per_rank=budget)


@st.composite
def batches(draw, cluster: Cluster, fill=0.6):
    """Lengths (with 1-token and odd sizes) whose total stays within `fill` of the capacity."""
    cap = int(cluster.world_size * cluster.tokens_per_rank * fill)
    longest = min(cluster.max_sample_length() // 2, cap)
    lengths, total = [], 0
    n = draw(st.integers(1, 40))
    for _ in range(n):
        ln = draw(st.one_of(st.sampled_from(ODD), st.integers(1, max(1, longest))))
        if total + ln > cap or not fits_memory_floors(lengths + [ln], cluster):
            break
        lengths.append(ln)
        total += ln
    if not lengths:
        lengths = [1]
    return samples_from_lengths(lengths)
