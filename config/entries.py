"""The entry points' own sections: each entry point's settings beyond the shared sections (the
ablation's seeds, the driver's mode, checkpoints and backends, the benchmarks' sizes).

A setting whose valid values are names another package owns (the modes of `solver.modes`, the
registered sparse kinds, the attention and pack backends, the shardings, the compute dtypes) has
its choices given by the entry point's `Command(choices=...)`, asked when parsing: the code that
implements the names is their one list.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import (
    MAX_REPEATS,
    MAX_STEPS,
    NON_EMPTY,
    Check,
    Section,
    int_in,
    list_from,
    names,
    number_in,
    optional,
    setting,
)
from .cluster import MAX_TOKENS_PER_RANK
from .model import ModelConfig

# tokens per rank of the runtime steps that measure the fixed costs (2: one label each; --step-tokens)
STEP_SAMPLE_TOKENS = 2

# the sweep's factors: factor -> the values it takes; each point is the defaults with that one factor changed
SWEEP_FACTORS = {
    "fill": [0.5, 0.75, 0.9, 0.95],
    "ratio": [1.0, 2.0, 4.0, 7.0, 10.0, 16.0],
    "long_share": [2.5e-4, 5e-4, 1e-3, 2e-3],
    "window": [1024, 4096, 16384],
    "kind": ["sliding_window", "chunked"],
    "cluster": [32, 64, 128, 1024, 4096],
    "state": [32, 64, 128, 256],  # a linear kind's head_k_dim = head_v_dim: its state's size
    "overlap": [1, 2, 4, 8, 16],  # head blocks the attention's exchanges are pipelined in (costs.overlap_blocks)
}
LINEAR_ONLY = ("state",)  # factors of a linear kind's model (docs/cost-model.md)
WHAT_IF = ("overlap",)  # factors the runtime cannot run, priced only (docs/cost-model.md)
NOT_DEFAULT = LINEAR_ONLY + WHAT_IF  # asked for by name, not in the default list


# ----- settings several entry points hold, declared once -----------------------------------------
# the same flag means the same thing in every entry point (tests/test_cli.py checks that a flag
# shared by two entry points sets a setting of the same name and doc)
def out(default: str):
    return setting(default, "the folder the results are written to", NON_EMPTY)


def whole_run(default: bool):
    return setting(
        default,
        "also plan and price every other step of the run in every mode (the parent solver rebalances steps without a wide "
        "parent too) and give each mode's change over the whole run beside the selected steps' (about six times the time)",
    )


def quick():
    return setting(False, "small sizes: a smoke run in seconds")


def repeats(default: int):
    return setting(
        default, "runs of every timed figure, the fastest kept (a shared machine's noise only slows a run)", int_in(1, MAX_REPEATS)
    )


def progress():
    return setting(True, "progress bars on stderr")


def timeout(default: float):
    return setting(default, "seconds a collective may wait before the job fails naming the rank", number_in(0, 86400, lo_open=True))


def step_tokens():
    return setting(
        STEP_SAMPLE_TOKENS,
        "tokens per rank of each sample of the runtime steps (the calibration's fit its fixed costs)",
        int_in(2, MAX_TOKENS_PER_RANK),
    )


def attn_backend():
    return setting("auto", "attention: auto (flash-attn, else torch's varlen, on CUDA; the torch path elsewhere)")


# ----- the sections -------------------------------------------------------------------------------
@dataclass(frozen=True)
class AblationOptions(Section):
    """The ablation: every mode on the same steps, for several workload seeds."""

    SECTION = "ablation"

    seeds: int = setting(5, "workload seeds, from --seed on (a mean without its range over seeds is not a result)", int_in(1, MAX_REPEATS))
    whole_run: bool = whole_run(True)
    out: str = out("results/ablation")
    progress: bool = progress()


@dataclass(frozen=True)
class SweepOptions(Section):
    """The one-factor-at-a-time sweep around the ablation's defaults."""

    SECTION = "sweep"

    factors: str = setting(
        ",".join(f for f in SWEEP_FACTORS if f not in NOT_DEFAULT),
        f"the factors to sweep, comma-separated, from {list(SWEEP_FACTORS)} (state: a linear kind's head dims; overlap: the "
        f"exchanges pipelined in head blocks, a priced what-if)",
        list_from(SWEEP_FACTORS),
    )
    seeds: int = setting(3, "workload seeds, from --seed on (a mean without its range over seeds is not a result)", int_in(1, MAX_REPEATS))
    whole_run: bool = whole_run(False)
    out: str = out("results/sweep")


@dataclass(frozen=True)
class TrainOptions(Section):
    """The training driver: the mode, the backends, checkpoints, a replay of an ablation's steps."""

    SECTION = "train"

    mode: str = setting("repack+solver", "the layout mode; all: every step in every mode, without optimizer steps (a replay)")
    replay: str = setting(None, "an ablation's results folder: run its first seed's selected steps (use --mode all)", type_=str)
    tokens: str = setting(None, "a token file: a .npy of uint16/uint32 ids, memory-mapped (with --doc-offsets)", type_=str)
    doc_offsets: str = setting(None, "document offsets .npy [n_docs + 1] of --tokens", type_=str)
    dtype: str = setting(
        "auto",
        "compute dtype: bf16 (fp32 master weights and gradient reduction; FSDP2 gathers bf16 parameters, or autocast when "
        "replicated), fp32 or fp64; auto: bf16 on CUDA, fp32 elsewhere",
    )
    pack_backend: str = setting("auto", "pack/unpack kernels: auto (Triton on CUDA, torch elsewhere), triton, torch")
    attn_backend: str = attn_backend()
    shard: str = setting("fsdp", "fsdp: FSDP2 over every rank; none: replicated parameters, bucketed all-reduce")
    save_every: int = setting(0, "checkpoint every N steps (0: never)", int_in(0, MAX_STEPS))
    ckpt_dir: str = setting("results/checkpoints", "the folder of the run's checkpoints")
    resume: bool = setting(False, "resume from the latest good checkpoint in --ckpt-dir")
    resume_step: int = setting(None, "resume from this step's checkpoint (implies --resume)", optional(int_in(0, MAX_STEPS)), type_=int)
    init_from: str = setting(
        None,
        "hf:DIR: start from the weights of a Hugging Face checkpoint (DIR's safetensors) of the model --model names, every rank "
        "loading its shard (FSDP2, any expert-parallel degree); a new run, not a --resume",
        type_=str,
    )
    save_hf: str = setting(
        None, "write the run's final weights into this folder as a Hugging Face checkpoint (config.json, model.safetensors)", type_=str
    )
    stop_after: int = setting(None, "stop (as if interrupted) after this many steps of the run", optional(int_in(1, MAX_STEPS)), type_=int)
    out: str = out("results/train")
    timeout: float = timeout(300.0)
    repeats: int = repeats(1)
    timers: bool = setting(False, "time each step's phases and exchanges (the device synchronized around each: a measurement run)")
    allow_nonfinite: bool = setting(False, "go on past a step whose loss is nan or inf (by default the run fails there)")


@dataclass(frozen=True)
class CalibrateOptions(Section):
    """The calibration: this machine's rates and fixed costs, fitted into a hardware profile."""

    SECTION = "calibrate"

    quick: bool = quick()
    median_of: int = setting(
        None, "timed runs each figure is the median of (default: 3 with --quick, else 7)", optional(int_in(1, MAX_REPEATS)), type_=int
    )
    step_tokens: int = step_tokens()
    step_rounds: int = setting(
        None,
        "rounds the runtime steps are timed in, every step once a round, each fixed cost the median of its rounds' fits "
        "(default: 3 x --median-of)",
        optional(int_in(1, MAX_REPEATS)),
        type_=int,
    )
    datasheet_peak: float = setting(
        None,
        "the peak FLOP/s the efficiencies are relative to (default: the measured matmul rate)",
        optional(number_in(0, 1e18, lo_open=True)),
        type_=float,
    )
    attn_backend: str = attn_backend()
    out: str = out("results/calibrate")
    timeout: float = timeout(600.0)


@dataclass(frozen=True)
class EmulateOptions(Section):
    """The emulated two-tier cluster: network namespaces joined by rate-limited links."""

    SECTION = "emulate"

    nodes: int = setting(4, "emulated nodes, one network namespace each", int_in(2, 32))
    inter_mbit: float = setting(800.0, "rate of each node's link to the others, both ways, in Mbit/s", number_in(0, 1e6, lo_open=True))
    burst_kb: int = setting(
        None, "the token bucket's burst on each node's link, KB: what a link passes at the wire's speed before it meets the rate "
        "(default: 2 ms of the rate, at least 8 KB: 20 KB at 80 Mbit/s, 200 KB at 800, so every call meets the rate, as on a NIC)",
        optional(int_in(2, 1 << 20)), type_=int,
    )  # fmt: skip
    compare: bool = setting(False, "calibrate, run the ablation on the cluster's shape, replay its steps, compare")
    wall_limit: float = setting(
        900.0, "seconds before every launcher of a run is killed (the replay's: x --repeats)", number_in(0, 7 * 86400, lo_open=True)
    )
    repeats: int = repeats(3)
    out: str = out("results/emulated")


@dataclass(frozen=True)
class ReportOptions(Section):
    """The report: the docs' marked blocks rendered from results."""

    SECTION = "report"

    results: str = setting("results", "the folder of the results the docs are rendered from", NON_EMPTY)
    docs: str = setting("docs", "the folder of the docs whose marked blocks are rendered (and the README beside it)", NON_EMPTY)
    strict: bool = setting(False, "fail when a block's results are missing, instead of keeping its old content")
    check_docs: bool = setting(
        False,
        "write nothing: rerun the commands behind every block that takes under two minutes (the ablation and its variants) "
        "into a temporary folder, render, and fail naming each block whose figures differ from the committed docs",
        flag="--check",
    )
    rerun: bool = setting(
        False,
        "first rerun the command behind every block, the long ones too (the sweeps, the benchmarks, the emulated cluster: "
        "about three hours here, on an otherwise idle machine), from a clean checkout, so that every block cites its "
        "commit; then render. Started again at that commit, it skips each command whose results already cite it",
    )
    progress: bool = progress()


def _fills_ok(v) -> bool:
    try:
        return isinstance(v, str) and all(0 < float(x) <= 1 for x in v.split(","))
    except ValueError:
        return False


FILLS = Check("a comma-separated list of fills in (0, 1]", _fills_ok)


def _ratios_ok(v) -> bool:
    try:
        return isinstance(v, str) and all(0 < float(x) <= 1e6 for x in v.split(","))
    except ValueError:
        return False


@dataclass(frozen=True)
class AdviseOptions(Section):
    """The decision: which mode pays for this model, workload and cluster, over the whole run."""

    SECTION = "advise"

    seeds: int = setting(3, "workload seeds, from --seed on (a mean without its range over seeds is not a result)", int_in(1, MAX_REPEATS))
    vary_ratio: str = setting(
        "1,14", "inter/intra ratios the answer is priced at beside the hardware's own, comma-separated (1: equal link rates)",
        Check("a comma-separated list of ratios in (0, 1e6]", _ratios_ok),
    )  # fmt: skip
    vary_fill: str = setting(
        "0.5,0.75", "fills the answer is priced at beside the workload's own, comma-separated (0.5: half-empty steps)",
        FILLS,
    )  # fmt: skip
    sensitivity_seeds: int = setting(1, "workload seeds of each ratio's and fill's point, from --seed on", int_in(1, MAX_REPEATS))
    min_gain: float = setting(
        1.0,
        "the least gain over the whole run, in percent of the baseline's time on every seed, that counts as paying (below it: "
        "no mode pays, run the baseline)",
        number_in(0, 100),
    )
    out: str = out("results/advise")
    progress: bool = progress()


@dataclass(frozen=True)
class GpuCheckOptions(Section):
    """The GPU check: the GPU tests and the kernel bench on a device."""

    SECTION = "gpu_check"

    out: str = out("results/gpu_check")


@dataclass(frozen=True)
class KernelBenchOptions(Section):
    """The pack/unpack kernels' bench."""

    SECTION = "bench"

    quick: bool = quick()
    out: str = out("results")


def _powers_of_two_ok(v) -> bool:
    return isinstance(v, str) and all(x.strip().isdigit() and 2 <= int(x) <= 256 and int(x) & (int(x) - 1) == 0 for x in v.split(","))


def worlds(default: str):
    return setting(
        default,
        "world sizes to start as local gloo ranks (ignored under torchrun: its ranks)",
        Check("a comma-separated list of powers of two, 2 to 256", _powers_of_two_ok),
    )


@dataclass(frozen=True)
class GroupsBenchOptions(Section):
    """The process groups' bench: how many groups the plans use, and what creating them costs."""

    SECTION = "bench"

    worlds: str = worlds("8,16,64")
    out: str = out("results")
    timeout: float = timeout(300.0)


@dataclass(frozen=True)
class ContentionBenchOptions(Section):
    """The contention bench: what a sample adds to a step as the ranks that loop over samples share the cores."""

    SECTION = "bench"

    worlds: str = worlds("2,4,8")
    samples: int = setting(16, "samples a loaded rank holds (the others: one)", int_in(2, 4096))
    step_tokens: int = step_tokens()
    rounds: int = setting(9, "rounds the steps are timed in, every step once a round; each figure the median", int_in(1, MAX_REPEATS))
    out: str = out("results")
    timeout: float = timeout(300.0)


def _ranks_ok(v) -> bool:
    try:
        return isinstance(v, str) and all((r := int(x)) >= 64 and r & (r - 1) == 0 for x in v.split(","))
    except ValueError:
        return False


@dataclass(frozen=True)
class SolverBenchOptions(Section):
    """The planner's bench: plan time against the baseline's, and the heuristics' gap to the exact optimum."""

    SECTION = "bench"

    quick: bool = quick()
    repeats: int = repeats(3)
    fills: str = setting(
        "0.5,0.95", "the fills of the cluster's tokens its steps are planned at, comma-separated (0.95: the ablation's)",
        FILLS,
    )  # fmt: skip
    ranks: str = setting(
        "64,256,1024,4096,16384", "the cluster sizes planned, comma-separated (above 4,096 ranks: one step); --quick plans 64 and 256",
        Check("a comma-separated list of powers of two, each at least 64", _ranks_ok),
    )  # fmt: skip
    out: str = out("results")


@dataclass(frozen=True)
class HostBenchOptions(Section):
    """The host work per rank per step: its placement, built from the step's plan."""

    SECTION = "bench"

    quick: bool = quick()
    # the modes whose host work differs: Ulysses children (baseline and the repack modes alike),
    # the hidden states' own all-to-all, halo children, and children of every kind in one plan
    modes: str = setting("repack+solver,redistribute,halo,choose", "the modes whose plans are timed, comma-separated", names())
    out: str = out("results")


@dataclass(frozen=True)
class MemoryOptions(Section):
    """The memory table: each model preset's memory per GPU at each cluster size."""

    SECTION = "memory"

    models: str = setting("small,paper", "model presets to tabulate, comma-separated", list_from(ModelConfig.PRESETS))
    gpu_gib: float = setting(80.0, "memory of one GPU in GiB, for the fits columns", number_in(0, 1e6, lo_open=True))
