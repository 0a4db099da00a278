"""Cost model shared by the solvers and the simulator.

All FLOP counts are forward FLOPs; a training step costs 3x forward compute (backward ~2x) and
runs every exchange twice (forward and backward). Sparse-attention costs come from a registry,
so a researcher's new kernel is priced by the solver and the simulator alike.
"""

from __future__ import annotations

import functools

import numpy as np

from config import CostsConfig, HardwareConfig, ModelConfig, SettingError

from .flops import FLOPS_PER_MAC, attention_flops, causal_keys, chunked_keys, sliding_window_keys  # noqa: F401 (re-exported)
from .kinds import (  # noqa: F401 (re-exported: the kinds' interface and registry, solver.kinds)
    MAX_PARAM,
    STATE_DTYPES,
    LinearKind,
    SparseKind,
    StatePassing,
    attention_held_projections,
    attention_parts,
    attention_projection_params,
    register_kind,
    register_sparse_cost,
    resolve_state_dtype,
    sparse_cost,
    sparse_kinds,
    with_sparse_defaults,
)
from .kinds.gated_delta import gated_delta_flops, gated_delta_map_flops, gated_delta_projections, gated_delta_ulysses  # noqa: F401

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
class CostModel:
    """Per-sample and per-group time estimates for one model on one kind of hardware.

    The node size is the cluster's (Cluster.gpus_per_node), never a second copy: exchange prices
    need it, so every planner and the simulator take `cost.for_cluster(cluster)`, the same model
    bound to that cluster's nodes (made once per node size and shared). A model built without
    one prices compute only and says so if asked for an exchange."""

    def __init__(self, model: ModelConfig, hw: HardwareConfig, gpus_per_node: int | None = None, costs: CostsConfig | None = None):
        self.model, self.hw, self.gpus_per_node = model, hw, gpus_per_node
        self.costs = tr = costs if costs is not None else CostsConfig()
        self._bound: dict[int, CostModel] = {} if gpus_per_node is None else {gpus_per_node: self}
        self.sparse = sparse_cost(model.sparse_kind)
        if self.sparse.resolve(model.sparse_params) != model.sparse_params:
            raise SettingError(
                f"sparse_params={model.sparse_params} of sparse kind {model.sparse_kind!r} miss parameters; its parameters "
                f"and defaults: {self.sparse.params} (solver.cost.with_sparse_defaults fills them in)"
            )
        m = model
        self.attn_proj_params = attention_projection_params(m)
        self.moe_active_params = m.top_k * 3 * m.hidden * m.expert_ffn + m.hidden * m.n_experts
        self.layer_params_active = self.attn_proj_params + self.moe_active_params
        # the S layers' projections: the kind's (an attention kind's are the attention's)
        self.sparse_proj_params = self.sparse.projection_params(m)
        self.sparse_layer_params_active = self.sparse_proj_params + self.moe_active_params
        self.lm_head_params = m.vocab * m.hidden
        gemm_rate = hw.peak_flops * hw.gemm_efficiency
        self.attn_rate = hw.peak_flops * hw.attention_efficiency
        # the kind's mixer (its flops, and a linear kind's state-passing maps) runs at its own rate
        self.sparse_rate = hw.peak_flops * self.sparse.efficiency(hw)
        self.sparse_sample_latency = self.sparse.sample_call_latency(hw)  # an S layer's call's seconds per sample
        # forward seconds per token of one layer's token-wise work (an F layer's; an S layer's where
        # a linear kind's projections differ), and of the LM head
        self.layer_token_time = FLOPS_PER_MAC * self.layer_params_active / gemm_rate
        self.sparse_layer_token_time = FLOPS_PER_MAC * self.sparse_layer_params_active / gemm_rate
        self.head_token_time = FLOPS_PER_MAC * self.lm_head_params / gemm_rate
        # passes of a training step in units of the forward: recompute re-runs a layer's forward
        # (exchanges included) in backward; selective recompute re-runs only attention
        full_recompute = tr.recompute == "full"
        self.layer_compute_passes = FWD_BWD_COMPUTE + (FWD_COMPUTE if full_recompute else 0.0)
        self.attention_passes = FWD_BWD_COMPUTE + (FWD_COMPUTE if tr.recompute in ("full", "selective") else 0.0)
        self.exchange_passes = FWD_BWD_EXCHANGES + (1 if full_recompute else 0)
        self.ep_degree = self._ep_degree()
        # exposed seconds per token of one layer's expert dispatch + combine, every pass
        self.moe_token_time = self._moe_token_time() if tr.moe_all_to_all else 0.0
        self._lines: dict[tuple[int, str], tuple[float, float]] = {}  # exchange_line per (group size, layer type)
        self._child_lines: dict[tuple[int, int], tuple[float, float]] = {}  # child_line per (size, parent)
        self._parent_fixed: dict[int, float] = {}  # parent_fixed per parent size
        self.byte_share = 1.0  # of each exchanged row's bytes a call moves (head_block's 1 / overlap_blocks)
        self._block: CostModel | None = None

    def for_cluster(self, cluster) -> CostModel:
        """This cost model with the exchanges priced for `cluster`'s nodes (Cluster.gpus_per_node)."""
        g = cluster.gpus_per_node
        if g not in self._bound:
            bound = CostModel(self.model, self.hw, g, self.costs)
            bound._bound = self._bound  # siblings share one table: binding again returns the same object
            self._bound[g] = bound
        return self._bound[g]

    def head_block(self) -> CostModel:
        """This model pricing one head block of an exchange pipelined in CostsConfig.overlap_blocks
        blocks: the same calls (each block pays a call's latency), each exchanged row's bytes split
        over the blocks (the full and sparse layers' heads, a halo's rows, a linear kind's maps and
        states; not a redistribution's hidden states, which are not pipelined). Made once."""
        if self._block is None:
            block = CostModel(self.model, self.hw, self.gpus_per_node, self.costs)
            block.byte_share = 1.0 / self.costs.overlap_blocks
            self._block = block
        return self._block

    def widest_group(self, cluster) -> int:
        """The widest group the planner may use: an aligned power of two within the cluster whose
        size divides the query heads, and divides or is divided by the key/value heads (a group
        wider than the KV heads replicates each of them over size / n_kv_heads ranks); a linear
        kind's S layers' parts likewise (splits_over)."""
        p = cluster.widest_group
        while p > 1 and not all(splits_over(self.model, t, p) for t in ("F", "S")):
            p //= 2
        return p

    # --- FLOPs (model FLOPs, for MFU) ---
    def active_params(self) -> float:
        # integers: the same sum as n_layers x layer_params_active where the S layers' projections are the attention's
        m = self.model
        return m.n_full * self.layer_params_active + m.n_sparse * self.sparse_layer_params_active + self.lm_head_params

    def linear_out_params(self) -> int:
        """A linear kind's S-layer output projection plus the MoE (what runs after its exit
        exchange): the exit's elements per token times the hidden size, and the active experts."""
        _, (parts, width) = ulysses_parts(self.model, "S")
        return sum(parts) * width * self.model.hidden + self.moe_active_params

    def layer_time_of(self, layer_type: str) -> float:
        """Forward seconds per token of one layer of `layer_type`'s token-wise work."""
        return self.sparse_layer_token_time if layer_type == "S" else self.layer_token_time

    def model_flops(self, lengths, causal: bool = True) -> float:
        """Training FLOPs of a step: 6 x active params x tokens + 3 x attention forward FLOPs
        (recompute is not model work). causal: full attention counts the (query, key) pairs a
        causal mask keeps, L (L + 1) / 2 (our convention); False: all L^2 pairs, the older
        convention some papers' MFU uses. Sparse kinds count their registered FLOPs either way."""
        n = np.asarray(lengths, dtype=np.float64)
        full_pairs = causal_keys(n) if causal else n * n
        attn = self.model.n_full * attention_flops(full_pairs, self.model) + self.model.n_sparse * self.sparse.flops(n, self.model)
        return float(FLOPS_PER_MAC * FWD_BWD_COMPUTE * self.active_params() * n.sum() + FWD_BWD_COMPUTE * attn.sum())

    # --- parameters, and what every step pays for them ---
    def expert_params(self) -> float:
        m = self.model
        return m.n_layers * m.n_experts * 3 * m.hidden * m.expert_ffn

    def total_params(self) -> float:
        m = self.model
        embed = 0 if m.tie_embeddings else m.vocab * m.hidden
        proj = m.n_full * self.attn_proj_params + m.n_sparse * self.sparse_proj_params  # integers: exact either way
        dense = proj + m.n_layers * m.hidden * m.n_experts + self.lm_head_params + embed
        return dense + self.expert_params()

    def sharded_params(self, world_size: int) -> tuple[float, float, float]:
        """Elements of the parameters by the FSDP2 module that shards them (model.sharding.shard_model),
        as it holds them over `world_size` ranks: every parameter padded on the dim it is sharded on
        (shard_dim) to a multiple of its shard group's ranks. (The root's: the embedding, the LM
        head where untied, the final norm; the blocks' dense ones: the projections, the routers,
        two norms a block, over every rank; the experts' of one rank's expert-parallel slot, over
        their replicas: world / ep_degree.) A linear kind's projections are taken as dividing
        (their rows are multiples of its heads' widths), and its convolution and per-head decay are
        left out, as total_params leaves them (under 1% of its layer)."""
        m = self.model
        ep = min(self.ep_degree, world_size)
        w, h, ffn = world_size, m.hidden, m.expert_ffn
        held = lambda *shape, ranks=w: padded_numel(shape, ranks)  # noqa: E731
        root = (1 if m.tie_embeddings else 2) * held(m.vocab, h) + held(h)
        attention = attention_held_projections(m, held)  # an F layer's
        sparse = self.sparse.held_projections(m, held)
        blocks = m.n_full * attention + m.n_sparse * sparse + m.n_layers * (held(m.n_experts, h) + 2 * held(h))
        slot, replicas = m.n_experts // ep, w // ep  # w1 and w3 [slot, hidden, ffn], w2 [slot, ffn, hidden]
        experts = m.n_layers * (2 * held(slot, h, ffn, ranks=replicas) + held(slot, ffn, h, ranks=replicas))
        return root, blocks, experts

    def grad_sync_volume(self, world_size: int) -> tuple[float, float, int]:
        """What a rank sends in a step's parameter gathers and gradient reductions, as FSDP2 runs
        them (BLOCK_GATHERS, ROOT_GATHERS; sharded_params): (gather bytes, reduction bytes,
        collectives over more than one rank). A ring collective of B bytes over n ranks sends
        B (n - 1) / n from each."""
        tr, m = self.costs, self.model
        root, blocks, experts = self.sharded_params(world_size)
        ep = min(self.ep_degree, world_size)
        replicas = world_size // ep
        ring = lambda n: (n - 1) / n  # noqa: E731
        dense = (ROOT_GATHERS * root + BLOCK_GATHERS * blocks) * ring(world_size)
        gather = tr.param_bytes * (dense + BLOCK_GATHERS * experts * ring(replicas))
        reduce = tr.grad_bytes * ((root + blocks) * ring(world_size) + experts * ring(replicas))
        calls = ROOT_GATHERS + 1 + m.n_layers * (BLOCK_GATHERS + 1)  # the root and the blocks, over every rank
        if ep > 1 and replicas > 1:  # the experts: a module of their own in each block, over their replicas
            calls += m.n_layers * (BLOCK_GATHERS + 1)
        return gather, reduce, calls

    def grad_sync_time(self, world_size: int) -> float:
        """Exposed seconds of the gradient reductions and parameter gathers of a step
        (grad_sync_volume), ring collectives at the inter-node rate once the world spans nodes;
        their bytes `grad_sync_overlap` hidden, their calls' latency not (a latency-bound collective
        has nothing to overlap)."""
        tr = self.costs
        if not tr.grad_sync or world_size == 1:
            return 0.0
        gather, reduce, calls = self.grad_sync_volume(world_size)
        g = self.gpus_per_node
        bw = self.hw.intra_node_bw if g is not None and world_size <= g else self.hw.inter_node_bw
        return (1 - tr.grad_sync_overlap) * (gather + reduce) / bw + calls * self.hw.collective_latency

    def optimizer_time(self, world_size: int) -> float:
        """Seconds of the optimizer step on this rank's shard of the parameters (memory-bound)."""
        tr = self.costs
        if not tr.optimizer:
            return 0.0
        return self.total_params() / world_size * tr.optimizer_bytes_per_param / self.hw.hbm_bw

    def _ep_degree(self) -> int:
        """The expert-parallel degree: the costs' where given, checked against the experts (it
        divides them) and, bound to a cluster with EP inside a node, the node (it fits); else a
        node's ranks, at most DEFAULT_EP, and the largest power of two of those that divides the
        experts (EP8 for the paper's model)."""
        tr, m, node = self.costs, self.model, self.gpus_per_node
        intra = tr.ep_placement == "intra"
        if tr.ep_degree is None:
            ep = min(DEFAULT_EP, node if (node is not None and intra) else DEFAULT_EP)
            while m.n_experts % ep:
                ep //= 2
            return ep
        ep = tr.ep_degree
        if m.n_experts % ep:
            raise SettingError(
                f"costs.ep_degree (--ep)={ep} does not divide model.n_experts (--n-experts)={m.n_experts}: each rank of "
                f"an expert-parallel group holds n_experts / ep_degree experts"
            )
        if not intra and node is not None and ep <= node:
            raise SettingError(
                f"costs.ep_placement (--ep-placement) is inter, but an expert-parallel group of costs.ep_degree (--ep)={ep} "
                f"aligned ranks lies inside a node of {node} (--gpus-per-node): use --ep-placement intra, or an EP degree wider than a node"
            )
        if intra and node is not None and ep > node:
            raise SettingError(
                f"costs.ep_degree (--ep)={ep} is wider than a node of {node} ranks (--gpus-per-node), and "
                f"costs.ep_placement (--ep-placement) is intra: use an EP degree of at most {node}, or --ep-placement inter"
            )
        return ep

    def moe_peers(self) -> tuple[int, int]:
        """(peers on a rank's node, peers on other nodes) of its expert-parallel group: aligned
        groups of ep_degree ranks, inside a node when they fit one. Unbound to a cluster, the
        placement says which."""
        ep, g = self.ep_degree, self.gpus_per_node
        if g is None:
            return (ep - 1, 0) if self.costs.ep_placement == "intra" else (0, ep - 1)
        same = min(ep, g)
        return same - 1, ep - same

    def moe_token_bytes(self) -> tuple[float, float]:
        """(intra-node, inter-node) bytes one token of a rank sends in one layer's expert
        all-to-alls over a step: top_k copies of its hidden state out (dispatch) and back
        (combine), every pass; the expectation under routing uniform over the experts, so a
        share 1/ep of them stays on the rank and each peer gets 1/ep."""
        if self.ep_degree == 1 or not self.costs.moe_all_to_all:
            return 0.0, 0.0
        m = self.model
        per_peer = 2 * self.exchange_passes * m.top_k * m.hidden * self.hw.bytes_per_element / self.ep_degree
        intra, inter = self.moe_peers()
        return per_peer * intra, per_peer * inter

    def _moe_token_time(self) -> float:
        """Exposed seconds per token of one layer's expert all-to-alls over a step: the bytes of
        moe_token_bytes at the experts' all-to-all rates (HardwareConfig.experts_rates; a group
        across nodes under the group reading at the cross-node rate), 1 - moe_overlap exposed."""
        ep = self.ep_degree
        if ep == 1:
            return 0.0
        intra, inter = self.moe_token_bytes()
        intra_bw, inter_bw = self.hw.experts_rates
        if inter and self.hw.ratio_reading == "group":
            seconds = (intra + inter) / inter_bw
        else:
            seconds = intra / intra_bw + inter / inter_bw
        return (1 - self.costs.moe_overlap) * seconds

    def moe_fixed_time(self) -> float:
        """Seconds every rank pays for its expert all-to-all calls' latencies over a step (every layer)."""
        return self.model.n_layers * self.moe_layer_fixed()

    def moe_layer_fixed(self) -> float:
        """Seconds of one layer's expert all-to-all calls over a step whatever their bytes: the
        counts, the dispatch and the combine forward (again under full recompute), the dispatch's
        and the combine's backward; each a call's latency, and what a call across nodes adds
        (latency is not hidden: a latency-bound call has nothing to overlap)."""
        if self.ep_degree == 1 or not self.costs.moe_all_to_all:
            return 0.0
        calls = MOE_FWD_CALLS * (self.exchange_passes - 1) + MOE_BWD_CALLS
        across = self.moe_peers()[1] > 0
        return calls * (self.hw.a2a_call_latency(self.ep_degree) + (self.hw.a2a_inter_latency if across else 0.0))

    # --- forward compute seconds, whole sample, all heads ---
    def full_attn_time(self, lengths):
        return attention_flops(causal_keys(lengths), self.model) / self.attn_rate

    def sparse_attn_time(self, lengths):
        return self.sparse.flops(np.asarray(lengths, dtype=np.float64), self.model) / self.sparse_rate

    def block_time(self, lengths):
        """Forward seconds a rank pays per sample (or chunk) of these lengths for the blocks of a
        linear kind's recurrence it loops over, whatever its share of the heads
        (HardwareConfig.linear_block_latency per block; 0 for other kinds and on GPUs)."""
        n = np.asarray(lengths, dtype=np.float64)
        if self.hw.linear_block_latency == 0:  # no blocks are priced (GPUs): whatever the kind
            return np.zeros_like(n)
        return self.sparse.recurrence_blocks(n, self.model.sparse_params) * self.hw.linear_block_latency

    def token_cost(self, tokens):
        """Training seconds of all token-wise work for `tokens` tokens on one rank: every layer's
        projections and experts (with recompute) and their expert all-to-all, and the LM head."""
        m = self.model
        layers = self.layer_compute_passes * self.sparse.layer_token_seconds(m, self.layer_token_time, self.sparse_layer_token_time)
        per_token = layers + FWD_BWD_COMPUTE * self.head_token_time + m.n_layers * self.moe_token_time
        return np.asarray(tokens, dtype=np.float64) * per_token

    def sample_cost(self, lengths):
        """Training seconds of one sample on one rank (the solvers' weight: its full attention and its token-wise work)."""
        return self.tokenwise_cost(lengths) + self.full_cost(lengths)

    def tokenwise_cost(self, lengths):
        """Training seconds of the work that runs in the child token layout (all but full attention)."""
        n = np.asarray(lengths, dtype=np.float64)
        return self.token_cost(n) + self.attention_passes * self.model.n_sparse * self.sparse_attn_time(n)

    def full_cost(self, lengths):
        n = np.asarray(lengths, dtype=np.float64)
        return self.attention_passes * self.model.n_full * self.full_attn_time(n)

    # --- exchanges ---
    def entry_row_bytes(self, group_size: int, layer_type: str = "F") -> float:
        """Bytes of one token's Q, K, V (all heads; a linear kind's S layer: what it declares,
        ulysses_parts) in an entry exchange, key/value heads replicated up to a wider group."""
        (parts, width), _ = ulysses_parts(self.model, layer_type)
        return exchanged_heads(parts, group_size) * width * self.hw.bytes_per_element * self.byte_share

    def kv_row_bytes(self) -> float:
        """Bytes of one token's keys and values (all key/value heads): a halo exchange's row."""
        m = self.model
        return 2 * m.n_kv_heads * m.head_dim * self.hw.bytes_per_element * self.byte_share

    def hidden_row_bytes(self) -> float:
        """Bytes of one token's hidden state: a redistribution's row."""
        return self.model.hidden * self.hw.bytes_per_element

    def exit_row_bytes(self, layer_type: str = "F") -> float:
        """Bytes of one token's attention output (a linear kind's S layer: its declared exit) in an exit exchange."""
        _, (parts, width) = ulysses_parts(self.model, layer_type)
        return sum(parts) * width * self.hw.bytes_per_element * self.byte_share

    def peers(self, start: int, size: int, rank: int) -> tuple[int, int]:
        """(other peers on rank's node, peers on other nodes) inside group [start, start + size)."""
        g = self.gpus_per_node
        if g is None:
            raise ValueError("this CostModel has no node size to price exchanges with: use cost.for_cluster(cluster)")
        node = rank // g
        lo, hi = max(start, node * g), min(start + size, (node + 1) * g)
        same = hi - lo
        return same - 1, size - same

    def exchange_time(self, tokens: float, start: int, size: int, rank: int, row_bytes: float) -> tuple[float, float]:
        """(intra, inter) seconds for `rank` to send its `tokens` rows' 1/size slices to each peer."""
        if size == 1:
            return 0.0, 0.0
        intra_peers, inter_peers = self.peers(start, size, rank)
        per_peer = tokens * row_bytes / size
        extra = self.hw.a2a_inter_latency if inter_peers else 0.0  # a call across nodes pays the network's round trip
        latency = self.hw.a2a_call_latency(size)
        if self.hw.ratio_reading == "group" and inter_peers:  # the whole all-to-all at the cross-node rate
            return latency, per_peer * (intra_peers + inter_peers) / self.hw.inter_node_bw + extra
        return (
            per_peer * intra_peers / self.hw.intra_node_bw + latency,
            per_peer * inter_peers / self.hw.inter_node_bw + extra,
        )

    def exchange_line(self, size: int, layer_type: str = "F") -> tuple[float, float]:
        """One layer's exchanges (fwd + bwd) in an aligned group of `size`, for x tokens per rank,
        as a * x + b: (seconds per token, fixed seconds). Cached per size and layer type."""
        line = self._lines.get((size, layer_type))
        if line is None:
            b = self.layer_exchange_time(0.0, 0, size, 0, layer_type)
            line = self._lines[(size, layer_type)] = (float(self.layer_exchange_time(1.0, 0, size, 0, layer_type) - b), float(b))
        return line

    def child_line(self, size: int, parent_size: int) -> tuple[float, float]:
        """Per-rank seconds of the token-layout work of a layout of `size` ranks inside a parent
        of `parent_size`, as (tokenwise + a * tokens) / size + b for the layout's tokenwise seconds and
        tokens: a holds its own exchanges at the sparse layers and its share of the parent's at
        the full layers; b the sparse layers' fixed cost. A group in its own layout is the case
        size == parent_size. The parent's full attention and parent_fixed come on top. Cached."""
        line = self._child_lines.get((size, parent_size))
        if line is None:
            m = self.model
            a_c, b_c = self.exchange_line(size, "S")
            a_p = self.exchange_line(parent_size)[0]
            line = self._child_lines[(size, parent_size)] = (m.n_sparse * a_c + m.n_full * a_p, m.n_sparse * b_c)
        return line

    def parent_fixed(self, parent_size: int) -> float:
        """Fixed seconds of a parent's full-layer exchanges (every rank of the parent waits them). Cached."""
        fixed = self._parent_fixed.get(parent_size)
        if fixed is None:
            fixed = self._parent_fixed[parent_size] = self.model.n_full * self.exchange_line(parent_size)[1]
        return fixed

    # --- a parent's time: shared_time + the slowest of its children's rank_time ---
    def shared_time(self, full_seconds: float, parent_size: int) -> float:
        """Per-rank seconds every rank of a parent spends on its full attention (`full_seconds`:
        full_cost summed over its samples, split over its ranks) and its full-layer exchanges'
        fixed cost. A parent's time is this plus its slowest child's rank_time."""
        return full_seconds / parent_size + self.parent_fixed(parent_size)

    def own_layout_time(self, lengths, size: int) -> float:
        """rank_time of a group of `size` ranks that keeps its own (evenly split) layout at every layer."""
        n = np.asarray(lengths, dtype=np.float64)
        return rank_time(float(self.tokenwise_cost(n).sum()), float(n.sum()), size, self.child_line(size, size))

    def group_rate(self, size: int) -> float:
        """Bytes per second a rank sends to its peers in one all-to-all of an aligned group of
        `size` ranks (latency aside): the effective rate the ratio and its reading imply."""
        per_byte = sum(self.exchange_time(1.0, 0, size, 0, 1.0)) - sum(self.exchange_time(0.0, 0, size, 0, 1.0))  # latencies cancel
        return (size - 1) / size / per_byte

    def halo_row_bytes(self) -> float:
        """Bytes of one halo row: a token's keys and values, or a linear kind's pre-convolution row."""
        return self.sparse.halo_row_elements(self.model) * self.hw.bytes_per_element * self.byte_share

    def state_bytes(self) -> float:
        """Bytes of one chunk's map (A, B) a linear kind's state passing sends (0 for other kinds)."""
        return self.sparse.state_elements(self.model.sparse_params) * self.state_element_bytes() * self.byte_share

    def carried_bytes(self) -> float:
        """Bytes of one state the chain carries from a chunk to the next (a linear kind's; 0 otherwise)."""
        return self.sparse.carried_elements(self.model.sparse_params) * self.state_element_bytes() * self.byte_share

    def state_element_bytes(self) -> int:
        """Bytes of one element of a linear kind's maps and states (its state_dtype)."""
        return STATE_DTYPES[resolve_state_dtype(self.sparse.state_dtype(self.model.sparse_params), self.hw.bytes_per_element)]

    def map_time(self, lengths):
        """Forward seconds of the maps of chunks of these lengths (a linear kind's state passing; 0 otherwise)."""
        n = np.asarray(lengths, dtype=np.float64)  # two recurrences a chunk: A's and B's
        return self.sparse.map_flops(n, self.model) / self.sparse_rate + 2 * self.block_time(n)

    def halo_line(self, parent_size: int, pass_seconds: float, map_seconds: float = 0.0) -> tuple[float, float]:
        """cost.rank_time's line of a halo child inside a parent of `parent_size`: its share of the
        parent's full-layer exchanges per token; as the fixed part, its sparse layers' halo
        exchanges (`pass_seconds` a pass at its slowest rank, solver.reference.halo_pass; every
        exchange pass) and the forward seconds of the maps its slowest rank forms (a linear
        kind's state passing; every attention pass). No head exchange."""
        m = self.model
        per_layer = self.exchange_passes * pass_seconds + self.attention_passes * map_seconds
        return m.n_full * self.exchange_line(parent_size)[0], m.n_sparse * per_layer

    def layer_exchange_time(self, tokens: float, start: int, size: int, rank: int, layer_type: str = "F") -> float:
        """Forward + backward seconds of one layer's entry and exit exchanges (`layer_type` 'F' or 'S')."""
        if size == 1:
            return 0.0
        a = sum(self.exchange_time(tokens, start, size, rank, self.entry_row_bytes(size, layer_type)))
        b = sum(self.exchange_time(tokens, start, size, rank, self.exit_row_bytes(layer_type)))
        return self.exchange_passes * (a + b)
