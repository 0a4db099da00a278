"""Triton kernels (with torch references beside them) for the exchanges around the all-to-all.

Kernels import nothing of the project but a plan's plain arrays (any object with the attributes
of solver.layout.RankExchange).
"""

from .exchange import CommStats, ExchangeArgs, ExchangeGroups, dist_transport, exchange, exchange_all_ranks, exchange_args, head_split_map
from .permute import gather_heads, scatter_heads

__all__ = [
    "CommStats",
    "ExchangeArgs",
    "ExchangeGroups",
    "dist_transport",
    "exchange",
    "exchange_all_ranks",
    "exchange_args",
    "head_split_map",
    "gather_heads",
    "scatter_heads",
]
