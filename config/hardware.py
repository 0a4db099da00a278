"""The hardware section: the rates and latencies the cost model prices, with named presets or a
profile measured by experiments.calibrate."""

from __future__ import annotations

from dataclasses import dataclass

from .base import Check, Section, SettingError, int_in, number_in, optional, profile_section, setting

RATIO_READINGS = ("group", "link")
H100 = "H100 SXM datasheet"


@dataclass(frozen=True)
class GpuDevice:
    """One kind of GPU as its datasheet gives it: what the hardware presets take their peak and
    memory bandwidth from, and what the kernels' machine-code checks size their budgets by."""

    name: str
    arch: int  # compute capability x 10: the sm_XX a kernel is compiled for
    sms: int
    hbm_bw: float  # bytes/s
    peak_flops: float  # dense bf16 FLOP/s
    source: str


GPU_DEVICES = {
    "a100": GpuDevice("A100 SXM 80GB", 80, 108, 2.039e12, 312e12, "NVIDIA A100 datasheet (SXM4 80GB)"),
    "h100": GpuDevice("H100 SXM", 90, 132, 3.35e12, 989e12, H100),
    "h200": GpuDevice("H200 SXM", 90, 132, 4.8e12, 989e12, "NVIDIA H200 datasheet (SXM): H100's compute, 4.8 TB/s HBM3e"),
    "b200": GpuDevice("B200", 100, 148, 8.0e12, 2.25e15, "NVIDIA DGX B200 datasheet, per GPU"),
}
# loaded device-memory latency, for Little's law (bytes in flight = bandwidth x latency): an
# assumption with a margin kept where it is used, not a measurement; pointer-chasing
# microbenchmarks put Hopper's idle HBM latency near 0.5 us, and a full-bandwidth load queues on top
MEMORY_LATENCY_S = 0.7e-6


# bounds that keep every price finite: a rate of 1e-300 bytes/s passes "> 0" but prices every
# exchange at 1e300 s, and a plan then fails far from the setting that caused it
BYTE_RATE = number_in(1e3, 1e15)  # bytes/s: 1 KB/s to 1 PB/s (the emulated cluster's slowest measured: ~5e7)
EFFICIENCY = number_in(1e-4, 1)
# what a calibration fits
FIXED_COSTS = ("layer_overhead", "a2a_latency", "a2a_inter_latency", "a2a_peer_latency", "halo_latency", "collective_latency")


@dataclass(frozen=True)
class HardwareConfig(Section):
    """What a step's compute and communication cost on one kind of GPU and network. The GPU
    presets keep the fixed costs (layer_overhead, collective_latency, a2a_inter_latency) at 0
    until measured: experiments.calibrate fits every field on the machines at hand."""

    SECTION = "hardware"

    name: str = setting("h100", "the preset or profile these figures came from (results carry it)", cli=False)
    peak_flops: float = setting(
        GPU_DEVICES["h100"].peak_flops, "dense bf16 FLOP/s per GPU (MFU's denominator)", number_in(1e6, 1e18), source=H100
    )
    gemm_efficiency: float = setting(
        0.70,
        "achieved / peak of large bf16 GEMMs and grouped expert GEMMs",
        EFFICIENCY,
        source="typical achieved large bf16 GEMM on H100 (~650-750 TFLOP/s)",
    )
    attention_efficiency: float = setting(
        0.55, "achieved / peak of varlen flash attention, forward and backward mixed", EFFICIENCY,
        source="FlashAttention-2/3 varlen forward + backward",
    )  # fmt: skip
    linear_efficiency: float = setting(
        None, "achieved / peak of a linear kind's mixer (its convolution and chunked recurrence), forward and backward "
        "mixed (unset: attention_efficiency's)", optional(EFFICIENCY), type_=float,
        source="no sourced GPU figure for the chunked kernels: attention_efficiency's unless measured (experiments.calibrate fits it)",
    )  # fmt: skip
    linear_block_latency: float = setting(
        0.0, "seconds of one forward of a linear kind's recurrence per block a rank runs, whatever its heads (a loop's "
        "iteration of the blockwise form; backward counts twice)", number_in(0, 60),
        source="0 on GPUs, where a chunked kernel runs every block of a call at once; the project's torch form loops over "
        "blocks (experiments.calibrate fits it from the mixer, and from the runtime's step of many one-block samples a rank)",
    )  # fmt: skip
    intra_node_bw: float = setting(
        150e9, "effective all-to-all bytes/s per GPU inside a node", BYTE_RATE,
        source="DeepEP's intranode all-to-all over NVLink (~150-160 GB/s)",
    )  # fmt: skip
    inter_intra_ratio: float = setting(
        7.0, "intra- over inter-node effective all-to-all rate", number_in(0, 1e6, lo_open=True), flag="--ratio",
        source="the paper's 'observed effective all-to-all rate is 7.0x lower than inside a node'",
    )  # fmt: skip
    ratio_reading: str = setting(
        "group",
        "what the ratio compares: group (a whole all-to-all across nodes runs at 1/ratio of the rate of one inside a node) "
        "or link (a byte to another node costs ratio x one inside)",
        choices=RATIO_READINGS,
        source="the paper's figure is a whole-group rate, as are FlexSP's measured 121 GB/s (SP8) and 8.7 GB/s (SP16)",
    )
    a2a_latency: float = setting(
        25e-6, "seconds one all-to-all call costs whatever its bytes (launch and sync)", number_in(0, 60),
        source="launch and sync of one NCCL collective",
    )  # fmt: skip
    a2a_inter_latency: float = setting(
        0.0, "seconds a call whose group spans nodes adds to a2a_latency (the network's round trip)", number_in(0, 60),
        source="no sourced GPU figure: 0 unless measured (experiments.calibrate fits it)",
    )  # fmt: skip
    a2a_peer_latency: float = setting(
        0.0, "seconds each peer past the first adds to an all-to-all call (a call sends to and receives from each peer in "
        "turn: a group of s ranks pays a2a_latency + (s - 2) x this)", number_in(0, 60),
        source="no sourced GPU figure: 0 (a call's latency whatever its group's size) unless measured "
        "(experiments.calibrate fits it from the groups of several sizes across nodes)",
    )  # fmt: skip
    halo_latency: float = setting(
        None, "seconds one halo exchange call costs whatever its bytes (a layer's point-to-point key/value sends and receives; "
        "a call across nodes adds a2a_inter_latency; unset: a2a_latency's)", optional(number_in(0, 60)), type_=float,
        source="no sourced GPU figure apart from an all-to-all's: a2a_latency's unless measured (experiments.calibrate fits it)",
    )  # fmt: skip
    experts_intra_bw: float = setting(
        None, "effective bytes/s per GPU of the experts' all-to-all inside a node (unset: intra_node_bw's)",
        optional(BYTE_RATE), type_=float,
        source="the same all-to-all over the same links as the exchanges, unless measured (experiments.calibrate fits it)",
    )  # fmt: skip
    experts_inter_bw: float = setting(
        None, "effective bytes/s per GPU of the experts' all-to-all across nodes (unset: the exchanges' inter-node rate)",
        optional(BYTE_RATE), type_=float,
        source="the same all-to-all over the same links as the exchanges, unless measured (experiments.calibrate fits it)",
    )  # fmt: skip
    bytes_per_element: int = setting(2, "bytes of one activation element (2: bf16)", int_in(1, 8))
    hbm_bw: float = setting(
        GPU_DEVICES["h100"].hbm_bw,
        "device memory bytes/s (the optimizer step is memory-bound)",
        BYTE_RATE,
        source=H100,
    )
    layer_overhead: float = setting(
        0.0, "seconds of one layer's forward on every rank whatever its tokens (launches, host work; backward counts twice)",
        number_in(0, 60), source="0 unless measured (experiments.calibrate fits it)",
    )  # fmt: skip
    attention_sample_latency: float = setting(
        0.0, "seconds one attention call spends per sample it holds a piece of, whatever its tokens (a forward; backward "
        "counts twice)", number_in(0, 60),
        source="0 on GPUs: flash-attn's varlen kernel runs every sample of a call in one launch; the torch path loops over "
        "the samples (experiments.calibrate fits it)",
    )  # fmt: skip
    collective_latency: float = setting(
        0.0, "seconds of one latency-bound collective (parameter gathers, gradient reductions, the router's all-reduces)",
        number_in(0, 60), source="0 unless measured (experiments.calibrate fits it)",
    )  # fmt: skip
    floored: tuple = setting(
        (),
        "the fixed costs a calibration fitted at the floor of their range (the runtime's step took no longer than its price "
        "without them): each is priced 0, a bound, not a measurement (the ablation says so in its header)",
        Check("a list of the fixed costs' names", lambda v: all(f in FIXED_COSTS for f in v)),
        cli=False,
    )

    @property
    def inter_node_bw(self) -> float:
        return self.intra_node_bw / self.inter_intra_ratio

    @property
    def linear_rate_efficiency(self) -> float:
        """achieved / peak of a linear kind's mixer (linear_efficiency, or attention_efficiency's)."""
        return self.attention_efficiency if self.linear_efficiency is None else self.linear_efficiency

    def a2a_call_latency(self, size):
        """Seconds of one all-to-all call in a group of `size` ranks whatever its bytes (a number,
        or a numpy array of sizes: per element): a2a_latency, and a2a_peer_latency for each peer
        past the first (what a call across nodes adds, a2a_inter_latency, is apart)."""
        past_first = size - 2
        return self.a2a_latency + self.a2a_peer_latency * past_first * (past_first > 0)

    @property
    def halo_call_latency(self) -> float:
        """Seconds of one halo exchange call inside a node (halo_latency, or a2a_latency's)."""
        return self.a2a_latency if self.halo_latency is None else self.halo_latency

    @property
    def experts_rates(self) -> tuple[float, float]:
        """(inside a node, across nodes) bytes/s of the experts' all-to-all."""
        intra = self.intra_node_bw if self.experts_intra_bw is None else self.experts_intra_bw
        return intra, self.inter_node_bw if self.experts_inter_bw is None else self.experts_inter_bw

    @classmethod
    def from_name(cls, name: str, **overrides) -> HardwareConfig:
        """A preset by name, or a hardware profile written by experiments.calibrate (a .json path)."""
        if name.endswith(".json"):
            return cls.from_profile(name, **overrides)
        return super().from_name(name, **overrides)

    @classmethod
    def from_profile(cls, path: str, **overrides) -> HardwareConfig:
        """The hardware of a profile (experiments.calibrate): its "hardware" section, checked setting
        by setting like any config. An empty or partial section is an error, not a preset."""
        section = profile_section(path, "hardware")
        where = f"hardware profile {path!r}: "
        cls.unknown(section, where)
        missing = sorted(set(cls.settings()) - set(section))
        if missing:
            raise SettingError(f"{where}the profile lacks {missing}: a profile holds every hardware setting (rerun the calibration)")
        try:
            return cls(**{**section, **overrides})
        except SettingError as e:
            raise SettingError(f"{where}{e}") from None


HardwareConfig.PRESETS = {
    "h100": HardwareConfig(),
    # H100's compute and links, H200's HBM bandwidth (the preset once kept H100's 3.35 TB/s)
    "h200": HardwareConfig(name="h200", hbm_bw=GPU_DEVICES["h200"].hbm_bw),
}
