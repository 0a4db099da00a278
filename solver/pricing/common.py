"""What every part of the cost model shares: a training step's passes, FSDP2's gathers and the
experts' calls, a parameter's padded shard, a layer's Ulysses parts, and the one line a layout's
time is read off (rank_time)."""

from __future__ import annotations

import functools

from config import ModelConfig

from ..kinds import attention_parts, sparse_cost

# Compute of a training step in units of the forward pass: backward computes the gradients of
# both the inputs and the weights of every matmul, about twice the forward's FLOPs.
FWD_COMPUTE = 1.0
BWD_COMPUTE = 2.0
FWD_BWD_COMPUTE = FWD_COMPUTE + BWD_COMPUTE
FWD_BWD_EXCHANGES = 2  # every exchange runs once forward and once (its inverse) backward
# FSDP2 as model.sharding.shard_model runs it: each block (and under expert parallelism its experts,
# a module of their own) gathers its parameters forward, frees them, and gathers them again for its
# backward (the default reshard after forward); the root (embedding, LM head, final norm) keeps
# them from its forward to its backward. Each module reduces its gradients once.
BLOCK_GATHERS, ROOT_GATHERS = 2, 1


def padded_numel(shape: tuple[int, ...], ranks: int, dim: int | None = None) -> int:
    """Elements of a parameter of this shape as FSDP2 holds it sharded over `ranks` on `dim`
    (shard_dim's where None): that dim padded to a multiple of `ranks`."""
    dim = shard_dim(shape, ranks) if dim is None else dim
    n = 1
    for d, size in enumerate(shape):
        n *= -(-size // ranks) * ranks if d == dim else size
    return n


def shard_dim(shape: tuple[int, ...], ranks: int) -> int:
    """The dim model.sharding.shard_model shards a parameter of this shape on over `ranks`: the one
    whose padding to a multiple of `ranks` adds the fewest elements, the first of equals (dim 0
    wherever it divides). FSDP2 pads the dim it shards, so a slot's 16 experts sharded on their
    first dim over 128 replicas would be gathered as 128 rows, 8x their bytes; on their hidden dim
    they are gathered once."""
    return min(range(len(shape)), key=lambda d: (padded_numel(shape, ranks, d), d))


DEFAULT_EP = 8  # expert parallelism over a node of 8 GPUs, where the costs leave the degree unset
# all-to-all calls of one MoE layer under expert parallelism (model.experts.ExpertDispatch): forward,
# the slot counts, the dispatch and the combine; backward, the dispatch's and the combine's reverse
MOE_FWD_CALLS, MOE_BWD_CALLS = 3, 2


def ulysses_parts(model: ModelConfig, layer_type: str) -> tuple[tuple[tuple[int, ...], int], tuple[tuple[int, ...], int]]:
    """What a layer of `layer_type` ('F' or 'S') moves in its Ulysses exchanges: ((entry parts,
    elements per head), (exit parts, elements per head)). A part is a count of heads: the first
    splits evenly over the group; a later one narrower than the group is replicated, each peer
    getting one head (kernels.exchange.head_split_map). Attention moves its q, k, v heads in and
    its output heads back; a linear kind moves what its `ulysses` declares."""
    return sparse_cost(model.sparse_kind).ulysses_parts(model) if layer_type == "S" else attention_parts(model)


@functools.lru_cache(maxsize=4096)  # a linear kind declares hundreds of parts, and every exchange line asks
def exchanged_heads(parts: tuple[int, ...], size: int) -> int:
    """Heads one token sends over an exchange in a group of `size` (all peers together): a part
    narrower than the group goes once to every peer (replicated)."""
    return sum(s if s % size == 0 else max(s, size) for s in parts)


def splits_over(model: ModelConfig, layer_type: str, size: int) -> bool:
    """Can a layer of `layer_type` run Ulysses over a group of `size` ranks: its exchanges' first
    parts split evenly, and each later part splits or is replicated (ulysses_parts)?"""
    (entry, _), (exit_, _) = ulysses_parts(model, layer_type)
    return entry[0] % size == 0 and exit_[0] % size == 0 and all(s % size == 0 or size % s == 0 for s in entry[1:])


# ----- per-rank time of a layout ---------------------------------------------------------------
def rank_time(tokenwise: float, tokens: float, size: int, line: tuple[float, float]) -> float:
    """Per-rank seconds of a layout of `size` ranks holding `tokenwise` seconds of token-layout work
    (CostModel.tokenwise_cost) over `tokens` tokens, on its cost line (a, b) (CostModel.child_line):
    (tokenwise + a * tokens) / size + b. The one definition of a child's (or an unrepacked group's)
    time: the solvers, the estimates and the fills all price a layout with it."""
    return (tokenwise + line[0] * tokens) / size + line[1]


# ----- the cost model -------------------------------------------------------------------------
