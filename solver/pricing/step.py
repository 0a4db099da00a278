"""The costs every mode pays whatever its layout: FSDP2's gathers and reductions, the optimizer
step, the experts' all-to-alls and their degree (solver.cost.CostModel's part)."""

from __future__ import annotations

from config import SettingError

from ..kinds import attention_held_projections
from .common import (
    BLOCK_GATHERS,
    DEFAULT_EP,
    MOE_BWD_CALLS,
    MOE_FWD_CALLS,
    ROOT_GATHERS,
    padded_numel,
)


class StepCosts:
    """What every mode pays for the step whatever its layout.

    A part of solver.cost.CostModel: its methods read the attributes CostModel.__init__ sets."""

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
        blocks = m.n_full * attention + m.n_sparse * sparse + m.n_layers * 2 * held(h)
        swiglu = lambda width: 2 * held(width, h) + held(h, width) if width else 0  # noqa: E731 (w1, w3; w2)
        shared = swiglu(m.shared_expert_ffn) + (held(1, h) if m.shared_expert_gate else 0)
        blocks += m.n_moe * (held(m.n_experts, h) + shared) + m.first_dense_layers * swiglu(m.dense_ffn)
        slot, replicas = m.n_experts // ep, w // ep  # w1 and w3 [slot, hidden, ffn], w2 [slot, ffn, hidden]
        experts = m.n_moe * (2 * held(slot, h, ffn, ranks=replicas) + held(slot, ffn, h, ranks=replicas))
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
        if ep > 1 and replicas > 1:  # the experts: a module of their own in each MoE block, over their replicas
            calls += m.n_moe * (BLOCK_GATHERS + 1)
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
        """Seconds every rank pays for its expert all-to-all calls' latencies over a step (every MoE block)."""
        return self.model.n_moe * self.moe_layer_fixed()

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
