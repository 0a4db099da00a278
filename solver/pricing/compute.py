"""A step's compute: the model's parameters and FLOPs, and the seconds of its token-wise
work and its attention per sample, at the rates of the hardware (solver.cost.CostModel's part)."""

from __future__ import annotations

import numpy as np

from ..flops import FLOPS_PER_MAC, attention_flops, causal_keys
from .common import (
    FWD_BWD_COMPUTE,
    ulysses_parts,
)


class ComputeCosts:
    """Compute: parameters, FLOPs and seconds of work per sample.

    A part of solver.cost.CostModel: its methods read the attributes CostModel.__init__ sets."""

    def active_params(self) -> float:
        # integers: the same sum as n_layers x layer_params_active where the S layers' projections are the attention's
        m = self.model
        return m.n_full * self.layer_params_active + m.n_sparse * self.sparse_layer_params_active + self.lm_head_params

    def linear_out_params(self) -> int:
        """A linear kind's S-layer output projection plus the MoE (what runs after its exit
        exchange): the exit's elements per token times the hidden size, and the active experts."""
        _, (parts, width) = ulysses_parts(self.model, "S")
        return sum(parts) * width * self.model.hidden + self.mlp_active_params["S"]

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

    def expert_params(self) -> float:
        """The routed experts' parameters, every MoE block's."""
        m = self.model
        return m.n_moe * m.n_experts * 3 * m.hidden * m.expert_ffn

    def total_params(self) -> float:
        """Every projection's and embedding's parameters (the norms, a linear kind's convolution and
        decay, biases and attention sinks left out: under 1% of a layer's)."""
        m = self.model
        embed = 0 if m.tie_embeddings else m.vocab * m.hidden
        proj = m.n_full * self.attn_proj_params + m.n_sparse * self.sparse_proj_params  # integers: exact either way
        mlp = m.n_moe * (m.hidden * m.n_experts + self.shared_mlp_params) + m.first_dense_layers * self.dense_mlp_params
        return proj + mlp + self.lm_head_params + embed + self.expert_params()

    def full_attn_time(self, lengths):
        return attention_flops(causal_keys(lengths), self.model) / self.attn_rate

    def sparse_attn_time(self, lengths):
        return self.sparse.flops(np.asarray(lengths, dtype=np.float64), self.model) / self.sparse_rate

    def token_cost(self, tokens):
        """Training seconds of all token-wise work for `tokens` tokens on one rank: every layer's
        projections and experts (with recompute) and their expert all-to-all, and the LM head."""
        m = self.model
        full, sparse = self.layer_token_time, self.sparse_layer_token_time
        layers = m.n_layers * full if sparse == full else m.n_full * full + m.n_sparse * sparse
        per_token = self.layer_compute_passes * layers + FWD_BWD_COMPUTE * self.head_token_time + m.n_moe * self.moe_token_time
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
