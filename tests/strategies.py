"""Hypothesis strategies shared by the solver and kernel tests."""

from hypothesis import strategies as st

from solver import Cluster, samples_from_lengths

ODD = [1, 2, 63, 97, 123]


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
        if total + ln > cap:
            break
        lengths.append(ln)
        total += ln
    if not lengths:
        lengths = [1]
    return samples_from_lengths(lengths)
