"""A model section read from a Hugging Face `config.json` (`--model hf:DIR`), for the three open
hybrid-attention MoE families the project prices: `qwen3_next` (Gated DeltaNet layers and gated
full attention, a shared expert), `kimi_linear` (Kimi Delta Attention layers and MLA, a dense first
block, a shared expert) and `gpt_oss` (sliding-window and full attention alternating, attention
sinks, biased and clamped SwiGLU experts).

Every layer of the config's `layer_types` becomes a layer of the project's pattern (full
attention: F; linear or sliding-window attention: S, of the matching sparse kind), and every shape
the cost model prices comes from the file: head counts and sizes per layer type, the routed and
shared experts, the dense first blocks, MLA's latents, the output gate. A config written in a
checkpoint's older spelling (Qwen3-Next's `full_attention_interval`, Kimi Linear's
`linear_attn_config` and `first_k_dense_replace`) reads as transformers reads it. What the
project cannot price is refused with a message that names it (a multi-token-prediction head,
dense blocks that are not the first ones, sliding windows on a model whose sparse layers are
linear), never dropped. Standard library only, like the rest of the config package.
"""

from __future__ import annotations

import json
import os

from .base import SettingError
from .model import ModelConfig

PREFIX = "hf:"
FAMILIES = ("qwen3_next", "kimi_linear", "gpt_oss")
# each family's name in layer_types of the project's F and S layers (read and written alike)
LAYER_NAMES = {
    "qwen3_next": {"F": "full_attention", "S": "linear_attention"},
    "kimi_linear": {"F": "full_attention", "S": "linear_attention"},
    "gpt_oss": {"F": "full_attention", "S": "sliding_attention"},
}
# the project's own settings of the linear kinds, which a config.json does not carry: the
# recurrence's block (a kernel's chunk) and the dtype its states travel in
LINEAR_DEFAULTS = {"block": 64, "state_dtype": "auto"}
_REQUIRED = object()


def config_path(spec: str) -> str:
    """The config.json of `hf:DIR` (DIR, or the file itself); SettingError naming what is missing."""
    path = spec[len(PREFIX) :] if spec.startswith(PREFIX) else spec
    if not path:
        raise SettingError(f"{spec!r}: give the folder that holds a transformers config.json, hf:DIR")
    file = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise SettingError(f"{spec!r}: no {file} (hf:DIR reads DIR/config.json, the file transformers writes beside the weights)")
    return file


def read_hf_config(spec: str, name: str | None = None) -> ModelConfig:
    """The model of a Hugging Face config (`hf:DIR`, DIR, or a .json path), named `name` (default:
    the spec as given, which results then carry)."""
    file = config_path(spec)
    with open(file) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise SettingError(f"{file}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise SettingError(f"{file}: holds a {type(raw).__name__}, not a config object")
    return from_hf_dict(raw, name or (spec if spec.startswith(PREFIX) else PREFIX + spec), where=file)


def from_hf_dict(raw: dict, name: str, where: str = "config.json") -> ModelConfig:
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise SettingError(
            f"{where}: model_type={family!r} is not a family the project reads; it reads {list(FAMILIES)} (hybrid-attention "
            f"MoEs whose layers it can price)"
        )
    c = _Reader(raw, where)
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers"):
        if c.get(key, default=0):
            raise SettingError(
                f"{where}: {key}={c.get(key)}: a multi-token-prediction head, which the project neither prices nor trains; "
                f"set it to 0 to price the model without it"
            )
    values = {"qwen3_next": _qwen3_next, "kimi_linear": _kimi_linear, "gpt_oss": _gpt_oss}[family](c)
    n_layers = c.need("num_hidden_layers")
    types = values.pop("layer_types")
    if len(types) != n_layers:
        raise SettingError(f"{where}: layer_types lists {len(types)} layers; num_hidden_layers={n_layers}")
    aux = c.get("router_aux_loss_coef", default=0.0) if c.get("output_router_logits", default=False) else 0.0
    common = {
        "name": name,
        "architecture": family,
        "n_layers": n_layers,
        "layer_pattern": _pattern(types),
        "hidden": c.need("hidden_size"),
        "n_heads": c.need("num_attention_heads"),
        "vocab": c.need("vocab_size"),
        "tie_embeddings": bool(c.get("tie_word_embeddings", default=False)),
        "norm_eps": c.get("rms_norm_eps", default=1e-6),
        "rope_theta": float(c.rope("rope_theta", 1e4)),
        "aux_loss_coef": aux,
    }
    try:
        return ModelConfig(**common, **values)
    except SettingError as e:
        raise SettingError(f"{where} ({family}): {e}") from None


def to_hf_dict(m: ModelConfig) -> dict:
    """The transformers config.json of a model the runtime builds from a Hugging Face family
    (gpt_oss, qwen3_next, kimi_linear), such that from_hf_dict reads it back as `m`; SettingError naming a
    family it cannot write, or a setting the family's config cannot carry."""
    writers = {"gpt_oss": _gpt_oss_dict, "qwen3_next": _qwen3_next_dict, "kimi_linear": _kimi_linear_dict}
    if m.architecture not in writers:
        raise SettingError(
            f"model {m.name}: no Hugging Face config is written for model.architecture={m.architecture!r}; these are: {sorted(writers)}"
        )
    common = {
        "model_type": m.architecture,
        "layer_types": [LAYER_NAMES[m.architecture][t] for t in m.layer_types],
        "num_hidden_layers": m.n_layers,
        "hidden_size": m.hidden,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "vocab_size": m.vocab,
        "tie_word_embeddings": m.tie_embeddings,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "output_router_logits": bool(m.aux_loss_coef),
        "router_aux_loss_coef": m.aux_loss_coef,
    }
    if m.architecture == "kimi_linear":  # its heads' sizes are MLA's (_kimi_linear_dict); it has no rotary
        for key in ("head_dim", "rope_theta"):
            del common[key]
    out = {**common, **writers[m.architecture](m)}
    differ = m.differing(from_hf_dict(json.loads(json.dumps(out)), m.name))
    if differ:
        raise SettingError(f"model {m.name}: {m.architecture}'s config cannot carry its {differ} as set here")
    return out


def _gpt_oss_dict(m: ModelConfig) -> dict:
    return {
        "architectures": ["GptOssForCausalLM"],
        "num_local_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "intermediate_size": m.expert_ffn,
        "sliding_window": m.sparse_params["window"],
        "rope_scaling": {"rope_type": "yarn", **m.rope_scaling} if m.rope_scaling else None,
        "attention_bias": m.attention_bias,
        "swiglu_limit": m.swiglu_limit,
        "swiglu_alpha": m.swiglu_alpha,
    }


def _qwen3_next_dict(m: ModelConfig) -> dict:
    p = m.sparse_params
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "partial_rotary_factor": (m.rotary_dim or m.head_dim) / m.head_dim,
        "linear_num_key_heads": p["k_heads"],
        "linear_num_value_heads": p["v_heads"],
        "linear_key_head_dim": p["head_k_dim"],
        "linear_value_head_dim": p["head_v_dim"],
        "linear_conv_kernel_dim": p["conv_kernel"],
        "num_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.expert_ffn,
        "shared_expert_intermediate_size": m.shared_expert_ffn,
        "intermediate_size": m.dense_ffn or m.expert_ffn,  # a dense block's width: unread where none is dense
        "mlp_only_layers": [],
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
    }


def _kimi_linear_dict(m: ModelConfig) -> dict:
    p = m.sparse_params
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "mlp_layer_types": ["dense" if i < m.first_dense_layers else "sparse" for i in range(m.n_layers)],
        "linear_attn_config": {"num_heads": p["v_heads"], "head_dim": p["head_v_dim"], "short_conv_kernel_size": p["conv_kernel"]},
        "qk_nope_head_dim": m.head_dim - m.qk_rope_dim,
        "qk_rope_head_dim": m.qk_rope_dim,
        "v_head_dim": m.v_dim,
        "kv_lora_rank": m.kv_lora_rank,
        "q_lora_rank": m.q_lora_rank,
        "num_experts": m.n_experts,
        "num_experts_per_token": m.top_k,
        "moe_intermediate_size": m.expert_ffn,
        "num_shared_experts": m.shared_expert_ffn // m.expert_ffn,
        "intermediate_size": m.dense_ffn or m.expert_ffn,  # a dense block's width: unread where none is dense
        "num_expert_group": m.router_groups,
        "topk_group": m.router_topk_groups,
        "routed_scaling_factor": m.routed_scaling,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "mla_use_nope": True,
        # the project's embedding has no padding row (one whose gradient is held at zero): nor has this model's,
        # and the class default's row (163839) may lie past a smaller vocabulary
        "pad_token_id": None,
    }


class _Reader:
    """A config's values, each looked up by one of its spellings."""

    def __init__(self, raw: dict, where: str):
        self.raw, self.where = raw, where

    def get(self, *keys: str, default=None):
        for key in keys:
            if key in self.raw and self.raw[key] is not None:
                return self.raw[key]
        return default

    def need(self, *keys):
        value = self.get(*keys, default=_REQUIRED)
        if value is _REQUIRED:
            raise SettingError(f"{self.where}: no {' or '.join(keys)}, which the project needs to price the model")
        return value

    def head_dim(self) -> int:
        """head_dim, or hidden_size / num_attention_heads where the config leaves it out."""
        return self.get("head_dim", default=self.need("hidden_size") // self.need("num_attention_heads"))

    def rope(self, key: str, default):
        """A rotary setting: transformers 5's rope_parameters, or the older top-level key."""
        params = self.raw.get("rope_parameters") or {}
        return params.get(key, self.get(key, default=default))


def _pattern(types: list[str]) -> str:
    """The shortest pattern of F and S that tiles the layers (the whole list where none does)."""
    s = "".join(types)
    n = len(s)
    for p in range(1, n + 1):
        if n % p == 0 and s[:p] * (n // p) == s:
            return s[:p]
    return s


def _types(c: _Reader, family: str, default: list[str]) -> list[str]:
    """The project's letter of each layer of the config's layer_types (`default` where it has none)."""
    names = {name: letter for letter, name in LAYER_NAMES[family].items()}
    raw = c.get("layer_types", default=default)
    out = []
    for i, t in enumerate(raw):
        if t not in names:
            raise SettingError(f"{c.where}: layer_types[{i}]={t!r}; this family's layer types: {list(names)}")
        out.append(names[t])
    return out


def _dense_prefix(c: _Reader, dense: list[int], key: str) -> int:
    """The number of first blocks that are dense, where the dense blocks are exactly those."""
    if dense != list(range(len(dense))):
        raise SettingError(
            f"{c.where}: {key} makes blocks {dense} dense; the project prices dense blocks only as the first ones "
            f"(first_dense_layers), not at other places"
        )
    return len(dense)


def _qwen3_next(c: _Reader) -> dict:
    n = c.need("num_hidden_layers")
    interval = c.get("full_attention_interval", default=4)
    default = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    if not c.get("norm_topk_prob", default=True):
        raise SettingError(f"{c.where}: norm_topk_prob=false: the project renormalizes a token's top-k expert weights")
    if c.get("attention_bias", default=False):
        raise SettingError(f"{c.where}: attention_bias=true on Qwen3-Next's attention: the project builds it without biases")
    if c.get("use_sliding_window", default=False):
        raise SettingError(f"{c.where}: use_sliding_window=true puts a window on full attention, which the project does not price")
    step, only = c.get("decoder_sparse_step", default=1), c.get("mlp_only_layers", default=[])
    dense = sorted(set(only) | {i for i in range(n) if not ((i + 1) % step == 0 and c.need("num_experts") > 0)})
    shared = c.get("shared_expert_intermediate_size", default=0)
    return {
        "layer_types": _types(c, "qwen3_next", default),
        "n_kv_heads": c.need("num_key_value_heads"),
        "head_dim": c.head_dim(),
        "attn_output_gate": True,  # Qwen3-Next's full attention always gates its output (q_proj twice as wide)
        "qk_norm": True,
        "zero_centered_norm": True,
        "rotary_dim": _rotary_dim(c),
        "n_experts": c.need("num_experts"),
        "top_k": c.need("num_experts_per_tok"),
        "expert_ffn": c.need("moe_intermediate_size"),
        "shared_expert_ffn": shared,
        "shared_expert_gate": bool(shared),
        "first_dense_layers": _dense_prefix(c, dense, "mlp_only_layers / decoder_sparse_step"),
        "dense_ffn": c.need("intermediate_size") if dense else 0,
        "sparse_kind": "gated_delta",
        "sparse_params": {
            "k_heads": c.need("linear_num_key_heads"),
            "v_heads": c.need("linear_num_value_heads"),
            "head_k_dim": c.need("linear_key_head_dim"),
            "head_v_dim": c.need("linear_value_head_dim"),
            "conv_kernel": c.need("linear_conv_kernel_dim"),
            **LINEAR_DEFAULTS,
        },
    }


def _rotary_dim(c: _Reader) -> int | None:
    """The rotary elements of a head: head_dim x partial_rotary_factor (None: all of them)."""
    head = c.head_dim()
    factor = c.rope("partial_rotary_factor", 1.0)
    return None if factor == 1.0 else int(head * factor)


def _kimi_linear(c: _Reader) -> dict:
    n = c.need("num_hidden_layers")
    linear = c.get("linear_attn_config", default={})
    if "full_attn_layers" in linear and "kda_layers" in linear and c.get("layer_types") is None:
        default = [None] * n  # the checkpoint's spelling: 1-based layer numbers
        for key, t in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for layer in linear[key]:
                if not 1 <= layer <= n:
                    raise SettingError(f"{c.where}: linear_attn_config.{key} names layer {layer}; the layers are 1 to {n}")
                default[layer - 1] = t
        missing = [i + 1 for i, t in enumerate(default) if t is None]
        if missing:
            raise SettingError(f"{c.where}: linear_attn_config names neither full nor KDA attention for layers {missing}")
    else:
        default = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if c.get("moe_layer_freq", default=1) != 1:
        raise SettingError(
            f"{c.where}: moe_layer_freq={c.get('moe_layer_freq')}: the project prices experts in every block after the dense ones"
        )
    mlp = c.get("mlp_layer_types")
    if mlp is None:
        first = c.get("first_k_dense_replace", default=1)
        mlp = ["dense" if i < first else "sparse" for i in range(n)]
    dense = [i for i, t in enumerate(mlp) if t == "dense"]
    # transformers' Kimi Linear: MLA without rotary, a sigmoid router whose top-k scores are renormalized
    for key, want in (
        ("mla_use_nope", True),
        ("moe_router_activation_func", "sigmoid"),
        ("moe_renormalize", True),
        ("norm_topk_prob", True),
    ):
        if c.get(key, default=want) != want:
            raise SettingError(f"{c.where}: {key}={c.get(key)!r}: transformers' Kimi Linear builds {key}={want!r} only")
    heads, ffn = linear.get("num_heads", c.get("linear_num_heads", default=32)), c.need("moe_intermediate_size")
    head_dim = linear.get("head_dim", c.get("linear_head_dim", default=128))
    nope, rope = c.need("qk_nope_head_dim"), c.need("qk_rope_head_dim")
    return {
        "layer_types": _types(c, "kimi_linear", default),
        "n_kv_heads": c.need("num_attention_heads"),  # MLA projects a key and a value for every head
        "head_dim": nope + rope,
        "v_head_dim": c.need("v_head_dim"),
        "kv_lora_rank": c.need("kv_lora_rank"),
        "q_lora_rank": c.get("q_lora_rank"),
        "qk_rope_dim": rope,
        "rotary_dim": 0,  # its MLA has no position embedding: the shared key elements reach the keys as they are
        "router_score": "sigmoid",
        "router_score_bias": True,  # e_score_correction_bias: chooses the experts, weights none
        "router_groups": c.get("num_expert_group", "n_group", default=1),
        "router_topk_groups": c.get("topk_group", default=1),
        "routed_scaling": float(c.get("routed_scaling_factor", default=2.446)),
        "n_experts": c.need("num_experts", "num_local_experts"),
        "top_k": c.need("num_experts_per_token", "num_experts_per_tok"),
        "expert_ffn": ffn,
        "shared_expert_ffn": c.get("num_shared_experts", "n_shared_experts", default=0) * ffn,
        "first_dense_layers": _dense_prefix(c, dense, "mlp_layer_types / first_k_dense_replace"),
        "dense_ffn": c.need("intermediate_size") if dense else 0,
        "sparse_kind": "kda",
        "sparse_params": {
            "k_heads": heads,
            "v_heads": heads,
            "head_k_dim": head_dim,
            "head_v_dim": head_dim,
            "conv_kernel": linear.get("short_conv_kernel_size", c.get("linear_conv_kernel_dim", default=4)),
            "gate_rank": head_dim,  # the decay's and the output gate's bottlenecks are one head wide
            **LINEAR_DEFAULTS,
        },
    }


def _gpt_oss(c: _Reader) -> dict:
    n = c.need("num_hidden_layers")
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return {
        "layer_types": _types(c, "gpt_oss", default),
        "n_kv_heads": c.need("num_key_value_heads"),
        "head_dim": c.head_dim(),
        "n_experts": c.need("num_local_experts", "num_experts"),
        "top_k": c.need("num_experts_per_tok", "experts_per_token"),
        "expert_ffn": c.need("intermediate_size"),
        "sparse_kind": "sliding_window",
        "sparse_params": {"window": c.need("sliding_window")},
        "attention_bias": bool(c.get("attention_bias", default=True)),
        "attention_sinks": True,  # every gpt-oss attention layer has its sinks
        "rope_scaling": _yarn(c),
        "router_bias": True,
        "router_softmax_topk": True,
        "expert_bias": True,
        "swiglu_limit": float(c.get("swiglu_limit", default=7.0)),
        "swiglu_alpha": float(c.get("swiglu_alpha", default=1.702)),
    }


def _yarn(c: _Reader) -> dict:
    """The rotary scaling: YaRN's parameters, or none."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return {}
    if kind != "yarn":
        raise SettingError(f"{c.where}: rotary scaling {kind!r}; the project runs YaRN's or none")
    if params.get("attention_factor") is not None or params.get("mscale") or params.get("mscale_all_dim"):
        raise SettingError(f"{c.where}: YaRN's attention_factor / mscale: the project takes YaRN's factor-derived scale only")
    return {
        "factor": float(params["factor"]),
        "original_max_position_embeddings": int(params["original_max_position_embeddings"]),
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "truncate": bool(params.get("truncate", True)),
    }


ModelConfig.READERS[PREFIX] = read_hf_config

# The three open hybrid-attention MoE families, each read from its flagship's config.json as
# shipped in config/hf_models (config.hf; its README gives each file's source and licence):
# qwen3-next-80b-a3b, kimi-linear-48b-a3b, gpt-oss-120b. paper-gdn is Qwen3-Next-80B-A3B exactly
# (Gated DeltaNet S layers, SSSF, its shared expert and gated attention priced); paper-kda is
# Kimi-Linear-48B-A3B exactly (KDA S layers, MLA full attention with its latents, a dense first
# block, a shared expert). The simulator prices them, and the runtime builds all three
# (model.hybrid.check_runnable names what it does not build)
HF_MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_models")
for _name in sorted(os.listdir(HF_MODELS)):
    if os.path.isfile(os.path.join(HF_MODELS, _name, "config.json")):
        ModelConfig.PRESETS[_name] = read_hf_config(os.path.join(HF_MODELS, _name), name=_name)
ModelConfig.PRESETS["paper-gdn"] = ModelConfig.PRESETS["qwen3-next-80b-a3b"].replace(name="paper-gdn")
ModelConfig.PRESETS["paper-kda"] = ModelConfig.PRESETS["kimi-linear-48b-a3b"].replace(name="paper-kda")
