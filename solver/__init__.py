"""Layouts, step plans, solvers, the cost model and the simulator: plain data (numpy, scipy),
no torch (tests/test_structure.py keeps it so)."""

from .cluster import Cluster, PlanError, Sample, check_samples, samples_from_lengths
from .config import HARDWARE_PRESETS, MODEL_PRESETS, TRAINING_PRESETS, HardwareConfig, ModelConfig, TrainingConfig
from .cost import CostModel, register_sparse_cost, sparse_cost
from .layout import (
    Group,
    RankExchange,
    TokenLayout,
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
from .plan import MODES, ParentPlan, StepPlan
from .planner import check_setup, make_plan, plan_from_parents

__all__ = [
    "Cluster",
    "PlanError",
    "Sample",
    "check_samples",
    "samples_from_lengths",
    "HARDWARE_PRESETS",
    "MODEL_PRESETS",
    "HardwareConfig",
    "ModelConfig",
    "TRAINING_PRESETS",
    "TrainingConfig",
    "CostModel",
    "register_sparse_cost",
    "sparse_cost",
    "Group",
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
    "MODES",
    "ParentPlan",
    "StepPlan",
    "check_setup",
    "make_plan",
    "plan_from_parents",
]
