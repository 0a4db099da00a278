"""The config tree: every setting of the project, each with its one-line doc, its check, the
source of its default and its one command-line spelling (docs/configuration.md lists them).

Plain dataclasses and the standard library: every other package imports this one, and it
imports nothing of ours (tests/test_structure.py keeps it so).

Sections: model, hardware, cluster, costs (what every step pays whatever its layout), workload,
planner, optim (the optimizer and its schedule); `config.entries` holds each entry point's own
(the ablation's seeds, the driver's mode and checkpoints, the benchmarks' sizes). `config.cli`
generates each entry point's command line from its sections and resolves precedence once.
"""

from .base import Check, Section, SettingError, setting
from .cluster import Cluster, ceil_pow2
from .costs import EP_PLACEMENTS, RECOMPUTE, CostsConfig
from .hardware import GPU_DEVICES, MEMORY_LATENCY_S, RATIO_READINGS, GpuDevice, HardwareConfig
from .hf import read_hf_config  # noqa: I001 (after the model: it registers hf:DIR and the shipped models' presets)
from .model import LAYER_TYPES, ModelConfig
from .optim import OptimConfig
from .planner import PRICINGS, PlannerConfig
from .workload import TINY_TOKENS_PER_RANK, WorkloadConfig

__all__ = [
    "Check",
    "Cluster",
    "CostsConfig",
    "EP_PLACEMENTS",
    "GPU_DEVICES",
    "GpuDevice",
    "HardwareConfig",
    "LAYER_TYPES",
    "MEMORY_LATENCY_S",
    "ModelConfig",
    "OptimConfig",
    "PRICINGS",
    "PlannerConfig",
    "RATIO_READINGS",
    "RECOMPUTE",
    "Section",
    "SettingError",
    "TINY_TOKENS_PER_RANK",
    "WorkloadConfig",
    "ceil_pow2",
    "read_hf_config",
    "setting",
]
