"""The kinds of the sparse layers, behind one interface: every question the cost model, the
simulator, the planner and the calibration ask of a kind is a call on its record here, never a
test of what the kind is.

A kind answers: its forward FLOPs per sample and the rate they run at; the parameters of its
layer's projections; what its Ulysses exchanges move (`ulysses_parts`); the row a halo exchange
moves for it; what its state passing moves (the map of a chunk, the state the chain carries: an
attention kind's null answer is zero elements, no hops); the blocks of its recurrence a rank
loops over; the halo ways it can run (`halo_ways`); how its layer's token-wise work splits around
its exchanges. `AttentionKind` answers for a mask over keys (solver.kinds.attention: the sliding
window, chunks); `LinearKind` for linear attention carrying a state along the sequence
(solver.kinds.gated_delta). A kind is registered once (`register_kind`) and looked up by name
(`sparse_cost`); model.attention registers an attention kind's mask and kernels beside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from config import HardwareConfig, ModelConfig, SettingError
from config.base import of_type

from ..layout import Way

SparseFlops = Callable[[np.ndarray, ModelConfig], np.ndarray]
FirstKey = Callable[[np.ndarray, dict], np.ndarray]  # (query positions, params) -> the first key position each may see
Parts = tuple[tuple[tuple[int, ...], int], tuple[tuple[int, ...], int]]  # ((entry parts, elements a head), (exit parts, ...))

MAX_PARAM = 2**62  # a sparse kind's numeric parameter: positions offset by it stay within int64

# the dtypes a linear kind carries its states in, by bytes an element (None: auto, the compute
# dtype where it is wider than float32, else float32: a chunked kernel keeps its state in float32
# whatever its inputs, as flash-linear-attention's gated delta rule kernels allocate it)
STATE_DTYPES = {"auto": None, "float32": 4, "float64": 8}


def resolve_state_dtype(state_dtype: str, activation_bytes: int) -> str:
    """The dtype a linear kind's states are carried in: `state_dtype` unless auto, where it is
    float32, or the compute dtype (float64) where that is wider: what a rank whose attention
    activations take `activation_bytes` an element: the cost model prices it, model.linear runs it."""
    if state_dtype not in STATE_DTYPES:
        raise SettingError(f"state_dtype={state_dtype!r} is not one of {list(STATE_DTYPES)}")
    if state_dtype != "auto":
        return state_dtype
    return "float64" if activation_bytes > STATE_DTYPES["float32"] else "float32"


def attention_parts(model: ModelConfig) -> Parts:
    """Attention's Ulysses exchanges: its q, k, v heads in and its output heads back."""
    m = model
    if m.v_dim == m.head_dim:
        return ((m.n_heads, m.n_kv_heads, m.n_kv_heads), m.head_dim), ((m.n_heads,), m.head_dim)
    # value heads of another size (MLA's): one element a part, element j of every q, k and v head
    # (a group wider than the key/value heads replicates each, as it does whole heads)
    return ((*(m.n_heads,) * m.head_dim, *(m.n_kv_heads,) * m.head_dim, *(m.n_kv_heads,) * m.v_dim), 1), ((m.n_heads,), m.v_dim)


def attention_projection_shapes(model: ModelConfig) -> list[tuple[int, int]]:
    """An attention layer's projections as (rows, columns) matrices, the output projection last:
    the fused query (with its output gate where attn_output_gate), key and value, or MLA's
    (kv_lora_rank set): the query (full-rank, or down to q_lora_rank and up), the key/value down
    projection to the latent and the shared rotary key elements, and the latent's up projection to
    every head's key (without its rotary part) and value."""
    m = model
    q = m.n_heads * m.head_dim * (2 if m.attn_output_gate else 1)
    out = (m.hidden, m.n_heads * m.v_dim)
    if m.kv_lora_rank is None:
        return [(q + m.n_kv_heads * (m.head_dim + m.v_dim), m.hidden), out]
    query = [(q, m.hidden)] if m.q_lora_rank is None else [(m.q_lora_rank, m.hidden), (q, m.q_lora_rank)]
    up = (m.n_heads * (m.head_dim - m.qk_rope_dim + m.v_dim), m.kv_lora_rank)
    return [*query, (m.kv_lora_rank + m.qk_rope_dim, m.hidden), up, out]


def attention_projection_params(model: ModelConfig) -> int:
    """Parameters of an attention layer's projections (attention_projection_shapes)."""
    return sum(r * c for r, c in attention_projection_shapes(model))


def attention_held_projections(model: ModelConfig, held: Callable[..., int]) -> int:
    """Elements of an attention layer's projections as FSDP2 holds them, held(*shape) a
    parameter's padded elements (attention_projection_shapes)."""
    return sum(held(*shape) for shape in attention_projection_shapes(model))


def attention_token_split(cost, layer_type: str = "F") -> tuple[float, float, float]:
    """An attention layer's token-wise work around its exchanges: (forward seconds a token, the
    share before its entry: every projection but the output, the share after its exit: the output
    projection and the feed-forward)."""
    rows, cols = attention_projection_shapes(cost.model)[-1]
    active = cost.layer_params_active if layer_type == "F" else cost.sparse_layer_params_active
    pre = (cost.attn_proj_params - rows * cols) / active
    return cost.layer_time_of(layer_type), pre, 1 - pre


@dataclass(frozen=True)
class StatePassing:
    """How a linear kind runs over contiguous chunks of a sample on consecutive ranks (its halo
    children, and the parent's own layout with halos): each chunk receives the pre-convolution
    rows its convolution reaches back to (the kind's first_key; halo_elements(params) elements a
    row) and the map (A, B) of every earlier chunk of its sample (state_elements(params) elements
    each), and composes them into its incoming state; each chunk whose sample goes on forms its own
    map first (map_flops(lengths, cfg): forward FLOPs of the maps of chunks of these lengths). Or,
    by the chain, it receives only its incoming state from the chunk before and sends its own on."""

    halo_elements: Callable[[dict], int]
    state_elements: Callable[[dict], int]
    map_flops: SparseFlops
    # the chain's alternative (Way.CHAIN): each chunk sends the next only its outgoing state,
    # carried_elements(params) elements, once it has its own
    carried_elements: Callable[[dict], int]
    # bytes of one element of a map or a state: its params' state_dtype (STATE_DTYPES)
    state_dtype: Callable[[dict], str] = lambda p: p["state_dtype"]


@dataclass(frozen=True)
class SparseKind:
    """A kind of sparse layer: its name, its forward FLOPs per sample (lengths [n], cfg) -> [n],
    its parameters with their defaults, its reach (first_key: the first key a query at a position
    may see, monotone in the position; None: not local, no halo exchange can serve it) and its
    own rule over its resolved parameters (check: a message naming what is wrong, or None). The
    methods are the interface every consumer calls; this base answers as an attention kind does."""

    name: str
    flops: SparseFlops
    params: dict = field(default_factory=dict)
    first_key: FirstKey | None = None
    check: Callable[[dict], str | None] | None = None

    # ----- compute ----------------------------------------------------------------------------
    def projection_params(self, model: ModelConfig) -> int:
        """Parameters of an S layer's projections (priced as token-wise work)."""
        return attention_projection_params(model)

    def held_projections(self, model: ModelConfig, held: Callable[..., int]) -> int:
        """Elements of an S layer's projections as FSDP2 holds them, held(*shape) a parameter's
        padded elements (attention_held_projections)."""
        return attention_held_projections(model, held)

    def efficiency(self, hw: HardwareConfig) -> float:
        """The share of the peak its FLOPs run at."""
        return hw.attention_efficiency

    def recurrence_blocks(self, lengths, params: dict) -> np.ndarray:
        """Blocks of a recurrence a rank loops over per sample of these lengths, whatever its share
        of the heads (each priced at HardwareConfig.linear_block_latency): none for attention."""
        return np.zeros_like(np.asarray(lengths, dtype=np.float64))

    def sample_call_latency(self, hw: HardwareConfig) -> float:
        """Seconds an attention call pays per sample it loops over (HardwareConfig.attention_sample_latency)."""
        return hw.attention_sample_latency

    def token_split(self, cost) -> tuple[float, float, float]:
        """An S layer's token-wise work around its exchanges: (forward seconds a token, the share
        before its entry exchange, the share after its exit): attention_token_split."""
        return attention_token_split(cost, "S")

    def heads_text(self, model: ModelConfig) -> str:
        """What else a group splits beyond the attention's heads, for messages ('' for attention)."""
        return ""

    # ----- exchanges --------------------------------------------------------------------------
    def ulysses_parts(self, model: ModelConfig) -> Parts:
        """What an S layer moves in its Ulysses exchanges (solver.cost.ulysses_parts)."""
        return attention_parts(model)

    def halo_row_elements(self, model: ModelConfig) -> int:
        """Elements of one halo row: a token's keys and values, all key/value heads."""
        return model.n_kv_heads * (model.head_dim + model.v_dim)

    # its calibration (experiments.calibrate): "attention", its S layers timed as attention (at
    # attention_efficiency, a call's cost per sample fitted as attention_sample_latency); or
    # "mixer", its mixer timed alone (linear_efficiency, and its cost per block: linear_block_latency)
    calibration: ClassVar[str] = "attention"
    per_sample_setting: ClassVar[str] = "attention_sample_latency"  # the hardware setting a sample's cost in a step fits

    # state passing: an attention kind passes no state (zero elements, no hops, no maps)
    halo_ways: ClassVar[tuple[Way, ...]] = (Way.HALO,)  # the ways a halo child of this kind can run (Way), the default first

    def state_elements(self, params: dict) -> int:
        """Elements of one chunk's map a halo child's one round sends."""
        return 0

    def carried_elements(self, params: dict) -> int:
        """Elements of the state the chain carries from a chunk to the next."""
        return 0

    def state_dtype(self, params: dict) -> str:
        """The dtype of its maps and states (STATE_DTYPES)."""
        return "float32"

    def map_flops(self, lengths, model: ModelConfig) -> np.ndarray:
        """Forward FLOPs of the maps of chunks of these lengths."""
        return np.zeros_like(np.asarray(lengths, dtype=np.float64))

    # ----- parameters -------------------------------------------------------------------------
    def check_local(self, what: str = "halo children") -> FirstKey:
        """The kind's reach, or SettingError naming the kind and what it lacks."""
        if self.first_key is None:
            raise SettingError(
                f"sparse kind {self.name!r} declares no reach (first_key: the first key a query may see), so {what} cannot "
                f"serve it: a halo exchange sends each rank the keys its queries reach back to; local kinds: "
                f"{sorted(k for k, c in _KINDS.items() if c.first_key is not None)}"
            )
        return self.first_key

    def resolve(self, given: dict) -> dict:
        """The kind's parameters: the given ones over the defaults. Raises SettingError naming an
        unknown or invalid parameter (a default's type is the type a value must have; numbers > 0)."""
        unknown = sorted(set(given) - set(self.params))
        if unknown:
            raise SettingError(f"sparse kind {self.name!r} has no parameter {unknown[0]!r}; its parameters: {self.params}")
        out = {**self.params, **given}
        for k, v in out.items():
            want = type(self.params[k])
            if want is str and not isinstance(v, str):
                raise SettingError(f"sparse kind {self.name!r}: {k}={v!r} is invalid; it takes a name (default {self.params[k]!r})")
            if not of_type(v, want) or (want in (int, float) and not (math.isfinite(v) and 0 < v < MAX_PARAM)):
                article = "an" if want.__name__[0] in "aeiou" else "a"
                raise SettingError(
                    f"sparse kind {self.name!r}: {k}={v!r} is invalid; it takes {article} {want.__name__} > 0 and below 2^62 (a reach "
                    f"in token positions, which numpy holds as int64; default {self.params[k]!r})"
                )
        problem = self.check(out) if self.check is not None else None
        if problem:
            raise SettingError(f"sparse kind {self.name!r}: {problem}")
        return out


AttentionKind = SparseKind  # a mask over keys: the base's answers


@dataclass(frozen=True)
class LinearKind(SparseKind):
    """Linear attention: its S layers carry a state along the sequence and have projections of
    their own (projections(cfg) parameters in place of the attention's q, k, v, o), priced as
    token-wise work, its `flops` counting the rest of the layer at its own rate
    (HardwareConfig.linear_rate_efficiency). ulysses(params): its Ulysses exchanges (heads split
    over a group, whole samples per head); passing: its state passing over chunks, with first_key
    its convolution's reach; head_names: its two head counts' parameter names (value, key), for
    messages; block: the name of its recurrence block's parameter."""

    projections: Callable[[ModelConfig], int] = None
    ulysses: Callable[[dict], Parts] = None
    passing: StatePassing = None
    block: str = "block"
    head_names: tuple[str, str] = ("v_heads", "k_heads")
    halo_ways: ClassVar[tuple[Way, ...]] = (Way.HALO, Way.CHAIN)
    calibration: ClassVar[str] = "mixer"
    per_sample_setting: ClassVar[str] = "linear_block_latency"

    def __post_init__(self):
        if self.projections is None or self.ulysses is None or self.passing is None:
            raise ValueError(f"linear kind {self.name!r} declares its projections, its Ulysses exchanges and its state passing")

    def projection_params(self, model: ModelConfig) -> int:
        return self.projections(model)

    def held_projections(self, model: ModelConfig, held: Callable[..., int]) -> int:
        return self.projections(model)  # taken as dividing: their rows are multiples of its heads' widths

    def efficiency(self, hw: HardwareConfig) -> float:
        return hw.linear_rate_efficiency

    def recurrence_blocks(self, lengths, params: dict) -> np.ndarray:
        return np.ceil(np.asarray(lengths, dtype=np.float64) / params[self.block])

    def sample_call_latency(self, hw: HardwareConfig) -> float:
        return 0.0  # its recurrence is priced by its blocks, not by the samples a call loops over

    def token_split(self, cost) -> tuple[float, float, float]:
        """Its in-projection before the entry; its out-projection and the experts after."""
        out = cost.linear_out_params() / cost.sparse_layer_params_active
        return cost.layer_time_of("S"), 1 - out, out

    def heads_text(self, model: ModelConfig) -> str:
        v, k = (model.sparse_params[n] for n in self.head_names)
        return f"; linear layers {v} value / {k} key heads"

    def ulysses_parts(self, model: ModelConfig) -> Parts:
        return self.ulysses(model.sparse_params)

    def halo_row_elements(self, model: ModelConfig) -> int:
        return self.passing.halo_elements(model.sparse_params)

    def state_elements(self, params: dict) -> int:
        return self.passing.state_elements(params)

    def carried_elements(self, params: dict) -> int:
        return self.passing.carried_elements(params)

    def state_dtype(self, params: dict) -> str:
        return self.passing.state_dtype(params)

    def map_flops(self, lengths, model: ModelConfig) -> np.ndarray:
        return self.passing.map_flops(np.asarray(lengths, dtype=np.float64), model)


_KINDS: dict[str, SparseKind] = {}


def register_kind(kind: SparseKind, overwrite: bool = False) -> None:
    """Register a kind under its name: every consumer finds it by sparse_cost(name)."""
    if kind.name in _KINDS and not overwrite:
        raise ValueError(f"sparse kind {kind.name!r} is already registered; pass overwrite=True to replace it")
    _KINDS[kind.name] = kind


def register_sparse_cost(
    name: str,
    flops: SparseFlops,
    params: dict | None = None,
    overwrite: bool = False,
    first_key: FirstKey | None = None,
    check: Callable[[dict], str | None] | None = None,
) -> None:
    """Register an attention kind's forward FLOPs, its parameters and their defaults, and, for a
    local kind, its reach (first_key(query positions, params): the first key each may see).
    model.attention.register_sparse_attention calls this together with the kernel; a linear kind
    registers a LinearKind (register_kind)."""
    register_kind(AttentionKind(name, flops, dict(params or {}), first_key, check), overwrite)


def sparse_kinds() -> list[str]:
    """The registered sparse kinds' names."""
    return sorted(_KINDS)


def sparse_cost(name: str) -> SparseKind:
    """The registered kind of this name; SettingError naming the registered ones."""
    if name not in _KINDS:
        raise SettingError(f"model.sparse_kind={name!r} is not a registered sparse kind; registered: {sorted(_KINDS)}")
    return _KINDS[name]


def with_sparse_defaults(model: ModelConfig) -> ModelConfig:
    """The model config with its sparse kind's parameters resolved (defaults filled in, unknown or
    invalid ones named in a SettingError)."""
    return model.replace(sparse_params=sparse_cost(model.sparse_kind).resolve(model.sparse_params))


from . import attention, gated_delta, kda  # noqa: E402, F401  (the built-in kinds register themselves)
