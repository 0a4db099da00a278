"""The workload section: the synthetic length distribution of a step's documents (or a trace), and
the batch each step packs."""

from __future__ import annotations

from dataclasses import dataclass

from .base import MAX_STEPS, SEED, Check, Section, SettingError, int_in, number_in, optional, setting
from .cluster import MAX_TOKENS_PER_STEP, Cluster

LENGTH = int_in(1, MAX_TOKENS_PER_STEP)  # a document's tokens: at most what the largest cluster's step holds

TINY_TOKENS_PER_RANK = 32  # the per-rank budget the tiny workload (and the tiny models) are sized for: a CPU step in well under a second
PAPER_SHARE = "about 10% of steps with SP16/32 parents on the default cluster, as in the paper (22 of 200)"


@dataclass(frozen=True)
class WorkloadConfig(Section):
    """Documents drawn i.i.d. from a two-part mixture and streamed whole into steps: a log-normal
    body (web and code documents) and, with a small probability, a long document log-uniform in
    [long_min, long_max] (books, repositories). `lengths` draws them from a published or a user's
    length distribution instead; `trace` replaces the generator with real steps."""

    SECTION = "workload"
    # two spellings of one batch size, two replacements of the generator: give one
    EXCLUSIVE = (("fill", "tokens_per_step"), ("lengths", "trace"))

    name: str = setting("default", "the preset this workload came from (results carry it)", cli=False)
    steps: int = setting(200, "steps of the workload: scanned by the simulated experiments, trained by the driver", int_in(1, MAX_STEPS))
    fill: float = setting(
        0.95,
        "a step's global batch as a fraction of the cluster's tokens (world_size x tokens_per_rank); unset where tokens_per_step sets it",
        optional(number_in(0, 1, lo_open=True)),
        type_=float,
        source="packing fills each rank's micro-batch close to its budget (Megatron's dynamic context parallelism, concat-and-chunk)",
    )
    tokens_per_step: int = setting(None, "the global batch of a step in tokens (instead of fill)", optional(LENGTH), type_=int)
    body_median: int = setting(2048, "median length of a body document", LENGTH, source="web/code documents")
    body_sigma: float = setting(1.2, "log-normal sigma of the body's lengths", number_in(0, 10))
    body_min: int = setting(16, "shortest body document", LENGTH)
    body_max: int = setting(32768, "longest body document (lengths are clipped)", LENGTH)
    long_prob: float = setting(5e-4, "probability that a document is a long one", number_in(0, 1), source=PAPER_SHARE)
    long_min: int = setting(49152, "shortest long document", LENGTH)
    long_max: int = setting(262144, "longest long document", LENGTH, source="books and repositories up to 256K tokens")
    seed: int = setting(0, "the workload's seed (the driver also seeds the model's initialization with it)", SEED)
    clip_to_cluster: bool = setting(
        False, "documents longer than the widest group holds are clipped to it, so the workload runs on any world size"
    )
    lengths: str = setting(
        None,
        "draw the documents from these lengths instead of the mixture (the body and long settings unused): a shipped "
        "distribution's name (flexsp-wikipedia) or a file of lengths, one a line (.txt, .txt.gz)",
        optional(Check("a name or a path", bool)),
        type_=str,
    )
    trace: str = setting(
        None, "a length trace (.csv step,length rows / .jsonl / .npy) instead of the generator", optional(Check("a path", bool)), type_=str
    )

    def check(self) -> None:
        if self.lengths is not None or self.trace is not None:  # the mixture is not drawn: its bounds are not read (config.reads)
            return
        if self.body_min > self.body_max or self.long_min > self.long_max:
            raise SettingError(
                f"workload bounds are crossed: body [{self.body_min}, {self.body_max}] (--body-min, --body-max), "
                f"long [{self.long_min}, {self.long_max}] (--long-min, --long-max)"
            )

    def batch_tokens(self, cluster: Cluster) -> int:
        """Tokens per step: tokens_per_step where set, else fill x the cluster's tokens."""
        if self.tokens_per_step is not None:
            return self.tokens_per_step
        if self.fill is None:
            raise SettingError("the workload has neither a fill nor tokens_per_step: give one (--fill or --tokens-per-step)")
        tokens = int(self.fill * cluster.world_size * cluster.tokens_per_rank)
        if tokens < 1:
            raise SettingError(
                f"{self.spelt('fill')}={self.fill!r} of {cluster.world_size} x {cluster.tokens_per_rank} tokens is less than one "
                f"token a step: use a larger fill, or --tokens-per-step"
            )
        return tokens

    def for_cluster(self, cluster: Cluster) -> WorkloadConfig:
        """This workload with its batch in tokens for `cluster` (what a generator and a replay read);
        the fill stays where it set the batch, and is unset where tokens_per_step did."""
        if self.tokens_per_step is not None:
            return self.replace(fill=None)
        return self.replace(tokens_per_step=self.batch_tokens(cluster))

    def clipped(self, longest: int) -> WorkloadConfig:
        """This workload with no document longer than `longest` (the widest group's tokens; drawn
        `lengths` are clipped at long_max)."""
        long_max = min(self.long_max, longest)
        body_max = min(self.body_max, long_max)
        return self.replace(
            long_max=long_max, long_min=min(self.long_min, long_max), body_max=body_max, body_min=min(self.body_min, body_max)
        )


WorkloadConfig.PRESETS = {
    "default": WorkloadConfig(),
    # a CPU step in well under a second: 5/8 of the cluster's tokens, short documents, frequent long ones
    "tiny": WorkloadConfig(
        name="tiny",
        fill=0.625,
        body_median=8,
        body_sigma=0.8,
        body_min=1,
        body_max=40,
        long_prob=0.04,
        long_min=48,
        long_max=120,
        clip_to_cluster=True,
    ),
    # FlexSP's Wikipedia workload (experiments/common/data/README.md): median 347 tokens, mean 1,014,
    # 0.13% of documents (7.6% of tokens) above 32K, the longest 1,823,777
    "flexsp-wikipedia": WorkloadConfig(name="flexsp-wikipedia", lengths="flexsp-wikipedia"),
}
