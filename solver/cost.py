"""Cost model shared by the solvers and the simulator.

All FLOP counts are forward FLOPs; a training step costs 3x forward compute (backward ~2x) and
runs every exchange twice (forward and backward). Sparse-attention costs come from a registry,
so a researcher's new kernel is priced by the solver and the simulator alike.
"""

from __future__ import annotations

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
from .pricing.common import (  # noqa: F401 (re-exported)
    BLOCK_GATHERS,
    BWD_COMPUTE,
    DEFAULT_EP,
    FWD_BWD_COMPUTE,
    FWD_BWD_EXCHANGES,
    FWD_COMPUTE,
    MOE_BWD_CALLS,
    MOE_FWD_CALLS,
    ROOT_GATHERS,
    exchanged_heads,
    padded_numel,
    rank_time,
    shard_dim,
    splits_over,
    ulysses_parts,
)
from .pricing.compute import ComputeCosts
from .pricing.exchanges import ExchangeCosts
from .pricing.kind import KindCosts
from .pricing.step import StepCosts


class CostModel(ComputeCosts, ExchangeCosts, KindCosts, StepCosts):
    """Per-sample and per-group time estimates for one model on one kind of hardware.

    The node size is the cluster's (Cluster.gpus_per_node), never a second copy: exchange prices
    need it, so every planner and the simulator take `cost.for_cluster(cluster)`, the same model
    bound to that cluster's nodes (made once per node size and shared). A model built without
    one prices compute only and says so if asked for an exchange.

    Its parts, one concern each (solver.pricing): ComputeCosts (parameters, FLOPs, seconds of work
    per sample), ExchangeCosts (rows, all-to-alls, a layout's cost line), KindCosts (what the
    sparse kind adds: halo rows, maps, carried states, recurrence blocks) and StepCosts (what every
    mode pays: FSDP2, the optimizer, the experts' all-to-alls)."""

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
        # a block's feed-forward: a MoE block's active experts, router and shared experts, or a dense
        # block's SwiGLU; per layer type, its blocks' mean (a token runs every block: exact in sum)
        self.shared_mlp_params = 3 * m.hidden * m.shared_expert_ffn + (m.hidden if m.shared_expert_gate else 0)
        self.moe_active_params = m.top_k * 3 * m.hidden * m.expert_ffn + m.hidden * m.n_experts + self.shared_mlp_params
        self.dense_mlp_params = 3 * m.hidden * m.dense_ffn
        self.mlp_active_params = {t: self._mean_mlp(t) for t in ("F", "S")}
        self.layer_params_active = self.attn_proj_params + self.mlp_active_params["F"]
        # the S layers' projections: the kind's (an attention kind's are the attention's)
        self.sparse_proj_params = self.sparse.projection_params(m)
        self.sparse_layer_params_active = self.sparse_proj_params + self.mlp_active_params["S"]
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

    def _mean_mlp(self, layer_type: str):
        """Active feed-forward parameters of a layer of `layer_type`, its blocks' mean: the MoE's
        (an integer) where none of them is dense."""
        m = self.model
        n, dense = m.layer_types.count(layer_type), m.n_dense_of(layer_type)
        if not dense:
            return self.moe_active_params
        return ((n - dense) * self.moe_active_params + dense * self.dense_mlp_params) / n

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
