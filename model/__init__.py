"""The hybrid 1F3S MoE model, its attention backends and its distributed step."""

from . import kda  # noqa: F401  (registers its mixer)
from .attention import check_sparse_flops, register_sparse_attention, sparse_kind, varlen_attention
from .hybrid import HybridMoE, LocalPlacement, next_token_labels

__all__ = [
    "HybridMoE",
    "LocalPlacement",
    "check_sparse_flops",
    "next_token_labels",
    "register_sparse_attention",
    "sparse_kind",
    "varlen_attention",
]
