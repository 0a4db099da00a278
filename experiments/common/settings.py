"""The settings a run uses, completed from what the command line resolved: the sparse kind's
declared parameters, the workload's batch in tokens for the cluster (and its documents clipped
to the widest group where the workload says so), and the cost model they price."""

from __future__ import annotations

from config import Cluster, CostsConfig, HardwareConfig, ModelConfig, SettingError, WorkloadConfig
from config.cli import Command, Settings
from config.cluster import MAX_WORLD_SIZE
from solver import CostModel
from solver.cost import sparse_kinds, with_sparse_defaults

from . import lengths as length_files
from . import memory
from .errors import InputError

# the most memory one accelerator has (288 GB of HBM3e: NVIDIA B300 and AMD MI355X, their
# datasheets): a model whose parameters could not fit it on any supported cluster is refused
# before anything is priced, as training refuses one that cannot fit its own ranks
MAX_DEVICE_BYTES = 288e9

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
    check_model_fits(s)
    if "workload" in s.sections and s.workload.lengths is not None:  # read (and cached) now: a bad file is one line naming its route
        try:
            length_files.distribution(s.workload.lengths)
        except InputError as e:
            raise InputError(f"{s.route('workload.lengths')}: {e}") from None
    if "costs" in s.sections and "cluster" in s.sections:  # the expert-parallel degree checked, and set where left to its default
        s = s.replace(costs=s.costs.replace(ep_degree=cost_model(s).ep_degree))
    if "workload" not in s.sections or not resolve_workload:
        return s
    wl = s.workload.for_cluster(s.cluster)
    if wl.clip_to_cluster:
        wl = wl.clipped(cost_model(s).widest_group(s.cluster) * s.cluster.tokens_per_rank)
    return s.replace(workload=wl)


def check_model_fits(settings: Settings) -> None:
    """SettingError naming the model's settings when its memory estimate (experiments.common.memory)
    exceeds the largest accelerator's even on the most favourable cluster: the widest supported
    world, FSDP2, experts spread as far as they divide, one token a rank, full recompute, bf16.
    Every shape has its own bound (config.model); this bounds what they make together, so no entry
    point prices a model that no cluster could train."""
    m = settings.model
    ep = min(m.n_experts & -m.n_experts, MAX_WORLD_SIZE)  # the largest power of two that divides the experts
    need = memory.estimate(m, MAX_WORLD_SIZE, 1, "fsdp", True, "full", ep)["total"]
    if need > MAX_DEVICE_BYTES:
        given = [settings.route(k) for k in sorted(settings.given) if k.startswith("model.")] or [settings.route("model.preset")]
        raise SettingError(
            f"model {m.name} as set ({', '.join(given)}) needs about {need / memory.GIB:,.0f} GiB per rank even on "
            f"{MAX_WORLD_SIZE:,} ranks under FSDP2 with EP{ep} and one token a rank, more than any accelerator holds "
            f"({MAX_DEVICE_BYTES / 1e9:.0f} GB): no supported cluster could train it, so it is not priced either"
        )


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
