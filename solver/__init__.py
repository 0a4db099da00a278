"""Layouts, step plans, solvers, the cost model and the simulator: plain data (numpy, scipy),
no torch (tests/test_structure.py keeps it so). Settings come from the config package."""

from .cluster import InternalError, PlanError, PlanInvariantError, Sample, check_samples, samples_from_lengths
from .cost import CostModel, register_sparse_cost, sparse_cost
from .layout import (
    Group,
    RankExchange,
    TokenLayout,
    Way,
    exchange_bytes,
    head_cu_seqlens,
    head_to_token_plan,
    head_to_token_rank,
    head_token_ids,
    simulate_exchange,
    token_ids,
    token_to_head_plan,
    token_to_head_rank,
)
from .plan import ParentPlan, StepPlan
from .planner import check_setup, make_plan

__all__ = [
    "InternalError",
    "PlanError",
    "PlanInvariantError",
    "Sample",
    "check_samples",
    "samples_from_lengths",
    "CostModel",
    "register_sparse_cost",
    "sparse_cost",
    "Group",
    "Way",
    "RankExchange",
    "TokenLayout",
    "exchange_bytes",
    "head_cu_seqlens",
    "head_to_token_plan",
    "head_to_token_rank",
    "token_to_head_plan",
    "token_to_head_rank",
    "head_token_ids",
    "simulate_exchange",
    "token_ids",
    "ParentPlan",
    "StepPlan",
    "check_setup",
    "make_plan",
]
