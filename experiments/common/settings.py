"""The settings a run uses, completed from what the command line resolved: the sparse kind's
declared parameters, the workload's batch in tokens for the cluster (and its documents clipped
to the widest group where the workload says so), and the cost model they price."""

from __future__ import annotations

from config import Cluster, CostsConfig, HardwareConfig, ModelConfig, WorkloadConfig
from config.cli import Command, Settings
from solver import CostModel
from solver.cost import sparse_kinds, with_sparse_defaults

# what a command line with a model section accepts beyond the settings' own checks: the registered
# sparse kinds (asked when parsing, so a kind registered at run time is one)
MODEL_CHOICES = {"model.sparse_kind": sparse_kinds}


def cost_model(settings: Settings) -> CostModel:
    """The cost model of the settings' model, hardware and costs, bound to its cluster."""
    return CostModel(settings.model, settings.hardware, costs=settings.costs).for_cluster(settings.cluster)


def prepare(settings: Settings, resolve_workload: bool = True) -> Settings:
    """`settings` with the sparse kind's parameters filled in with its defaults, the expert-parallel
    degree checked against the model and the cluster (or chosen: a node's, dividing the experts),
    and the workload resolved for the cluster (resolve_workload=False: left as given, for an entry
    point that resolves it for each cluster it runs). Raises SettingError naming a bad one."""
    if "model" not in settings.sections:  # an entry point of other sections only (the report's)
        return settings
    s = settings.replace(model=with_sparse_defaults(settings.model))
    if "costs" in s.sections and "cluster" in s.sections:  # the expert-parallel degree checked, and set where left to its default
        s = s.replace(costs=s.costs.replace(ep_degree=cost_model(s).ep_degree))
    if "workload" not in s.sections or not resolve_workload:
        return s
    wl = s.workload.for_cluster(s.cluster)
    if wl.clip_to_cluster:
        wl = wl.clipped(cost_model(s).widest_group(s.cluster) * s.cluster.tokens_per_rank)
    return s.replace(workload=wl)


def default_settings(model: str | None = None, **flags: str) -> Settings:
    """The prepared settings of a default run (the ablation's shared sections, every setting at its
    default, the model preset `model` where given, and `flags` as a command line would give them:
    {"--steps": "60"}): what the docs' tables and figures rendered from the config tree use, so
    they price the steps the entry points run and not a cost model built by hand."""
    argv = ["--model", model] if model else []
    for flag, value in flags.items():
        argv += [flag, str(value)]
    sections = (ModelConfig, HardwareConfig, Cluster, CostsConfig, WorkloadConfig)
    return prepare(Command("defaults", "", sections, choices=MODEL_CHOICES).parse(argv))
