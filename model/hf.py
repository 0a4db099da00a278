"""A Hugging Face checkpoint's weights to and from the project's model (a state-dict adapter per
family): the names transformers gives each tensor, and how the project holds it (the fused
query/key/value projection, the experts' gate and up projections apart).

    to_hf(cfg, tensors)    the project's tensors (a state dict, or its gradients) -> transformers' names
    from_hf(cfg, tensors)  transformers' tensors -> the project's names, as HybridMoE.load_state_dict takes them
    load_hf(model, folder) a checkpoint's weights into the model, replicated or sharded (FSDP2, EP),
                           a block at a time; a part it does not build (Qwen3-Next's mtp.*) left out, saying so
    save_hf(model, folder) the model's weights as a checkpoint transformers loads (collective)

Both are exact (a copy or a slice of each element, no arithmetic), so project -> Hugging Face ->
project gives every weight back bit for bit. The Hugging Face families whose blocks the runtime
builds have an adapter (gpt_oss, qwen3_next, kimi_linear); another is refused by name (model.hybrid.
check_runnable says what it lacks).
"""

from __future__ import annotations

import functools
import json
import os

import torch
import torch.distributed as dist

from config import ModelConfig, SettingError
from config.hf import to_hf_dict
from solver.cluster import InternalError

from .experts import Experts

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
SWIGLU = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))  # the project's SwiGLU weights, transformers' names


def _family(cfg: ModelConfig) -> str:
    if cfg.architecture not in ADAPTERS:
        raise SettingError(
            f"model {cfg.name}: no Hugging Face weights for model.architecture={cfg.architecture!r}; the adapters here: {sorted(ADAPTERS)}"
        )
    return cfg.architecture


def to_hf(cfg: ModelConfig, tensors, into=None):
    """The project's tensors (HybridMoE's names; a dict, or Tensors) under transformers' names for
    cfg's family, put into `into` one by one as each is made (default: a new dict, returned)."""
    return ADAPTERS[_family(cfg)][0](cfg, Tensors.of(tensors, into))


# a checkpoint's tensors of parts the project neither prices nor trains, which transformers skips
# too: Qwen3-Next's multi-token-prediction head (mtp.*). from_hf leaves them out only when asked to
# (load_hf does, and says how many it left out)
UNBUILT_PARTS = {"qwen3_next": ("mtp.", "its multi-token-prediction head")}


class Tensors:
    """A checkpoint's tensors by name, each made only when an adapter takes it (pop): read from its
    file (Tensors.files: safetensors' safe_open reads that one tensor), or a dict's. An adapter
    takes each tensor once and hands what it makes from it to `into` (a dict, or load_hf's writer
    into the model's shards), so a loader holds the tensors of the part it is converting (a block's
    experts at most), never the whole checkpoint."""

    def __init__(self, getters: dict, into=None):
        self._get = getters
        self.into = {} if into is None else into  # where the adapter puts the project's tensors

    @classmethod
    def of(cls, tensors, into=None) -> Tensors:
        """A dict's tensors (the dict itself is left as it is)."""
        if isinstance(tensors, Tensors):
            return cls(dict(tensors._get), into if into is not None else tensors.into)
        return cls({k: (lambda v=v: v) for k, v in tensors.items()}, into)

    @classmethod
    def files(cls, paths: list[str]) -> Tensors:
        """The tensors of these safetensors files, each read when taken."""
        from safetensors import safe_open  # noqa: PLC0415 (transformers' dependency; needed only here)

        opened = {}  # each file opened once, at its first tensor taken (its header parsed once, not per tensor)

        def read(path, name):
            if path not in opened:
                opened[path] = safe_open(path, framework="pt")
            return opened[path].get_tensor(name)

        getters = {}
        for path in paths:
            with safe_open(path, framework="pt") as f:
                getters |= {name: functools.partial(read, path, name) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
        return cls(getters)

    def __iter__(self):
        return iter(self._get)

    def __len__(self) -> int:
        return len(self._get)

    def __contains__(self, name) -> bool:
        return name in self._get

    def keys(self):
        return self._get.keys()

    def pop(self, name: str) -> torch.Tensor:
        return self._get.pop(name)()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._get[name]()

    def renamed(self, rename) -> Tensors:
        """The same tensors under rename(name)."""
        return Tensors({rename(k): v for k, v in self._get.items()}, self.into)

    def without(self, names) -> Tensors:
        names = set(names)
        return Tensors({k: v for k, v in self._get.items() if k not in names}, self.into)


def unbuilt(cfg: ModelConfig, tensors) -> tuple[Tensors, list[str], str]:
    """(tensors without those of a part the project does not build, their names, the part in words)."""
    prefix, what = UNBUILT_PARTS.get(cfg.architecture, (None, ""))
    tensors = Tensors.of(tensors)
    left = sorted(k for k in tensors if prefix is not None and k.startswith(prefix))
    return tensors.without(left), left, what


def from_hf(cfg: ModelConfig, tensors, into=None):
    """transformers' tensors of cfg's family (a dict, or Tensors) under the project's names, put
    into `into` one by one as each is made (default: a new dict, returned); SettingError naming a
    tensor that is missing or left over (nothing is dropped: unbuilt() takes a part the project
    does not build out first, by name)."""
    return ADAPTERS[_family(cfg)][1](cfg, Tensors.of(tensors, into))


def _root_to_hf(cfg: ModelConfig, t: Tensors):
    out = t.into
    out["model.embed_tokens.weight"], out["model.norm.weight"] = t["embed.weight"], t["norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = t["lm_head.weight"]
    return out


def _root_from_hf(cfg: ModelConfig, t: Tensors):
    out = t.into
    out["embed.weight"], out["norm.weight"] = t.pop("model.embed_tokens.weight"), t.pop("model.norm.weight")
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = t.pop("lm_head.weight")
    return out


def _gpt_oss_to_hf(cfg: ModelConfig, t: dict) -> dict:
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    out = _root_to_hf(cfg, t)
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = t[f"{ours}wqkv.{kind}"].split([h * d, hkv * d, hkv * d])
            out |= {f"{theirs}self_attn.q_proj.{kind}": q, f"{theirs}self_attn.k_proj.{kind}": k, f"{theirs}self_attn.v_proj.{kind}": v}
            out[f"{theirs}self_attn.o_proj.{kind}"] = t[f"{ours}wo.{kind}"]
        out[f"{theirs}self_attn.sinks"] = t[f"{ours}sinks"]
        out[f"{theirs}input_layernorm.weight"] = t[f"{ours}attn_norm.weight"]
        out[f"{theirs}post_attention_layernorm.weight"] = t[f"{ours}moe_norm.weight"]
        out[f"{theirs}mlp.router.weight"] = t[f"{ours}moe.router.weight"]
        out[f"{theirs}mlp.router.bias"] = t[f"{ours}moe.router.bias"]
        e = f"{ours}moe.experts."
        # gate and up interleaved along the last dim: element 2j is the gate's j-th, 2j + 1 the up's
        out[f"{theirs}mlp.experts.gate_up_proj"] = torch.stack([t[e + "w1"], t[e + "w3"]], dim=-1).flatten(-2)
        out[f"{theirs}mlp.experts.gate_up_proj_bias"] = torch.stack([t[e + "b1"], t[e + "b3"]], dim=-1).flatten(-2)
        out[f"{theirs}mlp.experts.down_proj"] = t[e + "w2"]
        out[f"{theirs}mlp.experts.down_proj_bias"] = t[e + "b2"]
    return out


def _gpt_oss_from_hf(cfg: ModelConfig, t: dict) -> dict:
    out = _root_from_hf(cfg, _checked(t, to_hf(cfg, _shapes_only(cfg)).keys()))
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            parts = [t.pop(f"{theirs}self_attn.{p}_proj.{kind}") for p in "qkv"]
            out[f"{ours}wqkv.{kind}"] = torch.cat(parts)
            out[f"{ours}wo.{kind}"] = t.pop(f"{theirs}self_attn.o_proj.{kind}")
        out[f"{ours}sinks"] = t.pop(f"{theirs}self_attn.sinks")
        out[f"{ours}attn_norm.weight"] = t.pop(f"{theirs}input_layernorm.weight")
        out[f"{ours}moe_norm.weight"] = t.pop(f"{theirs}post_attention_layernorm.weight")
        out[f"{ours}moe.router.weight"] = t.pop(f"{theirs}mlp.router.weight")
        out[f"{ours}moe.router.bias"] = t.pop(f"{theirs}mlp.router.bias")
        e = f"{ours}moe.experts."
        gate_up, bias = t.pop(f"{theirs}mlp.experts.gate_up_proj"), t.pop(f"{theirs}mlp.experts.gate_up_proj_bias")
        out[e + "w1"], out[e + "w3"] = gate_up[..., 0::2].contiguous(), gate_up[..., 1::2].contiguous()
        out[e + "b1"], out[e + "b3"] = bias[..., 0::2].contiguous(), bias[..., 1::2].contiguous()
        out[e + "w2"] = t.pop(f"{theirs}mlp.experts.down_proj")
        out[e + "b2"] = t.pop(f"{theirs}mlp.experts.down_proj_bias")
    return out


def _qwen3_next_to_hf(cfg: ModelConfig, t: dict) -> dict:
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    p = cfg.sparse_params
    hk, hv, dk, dv = p["k_heads"], p["v_heads"], p["head_k_dim"], p["head_v_dim"]
    r = hv // hk  # value heads a key head serves
    out = _root_to_hf(cfg, t)
    for i, kind in enumerate(cfg.layer_types):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out[f"{theirs}input_layernorm.weight"] = t[f"{ours}attn_norm.weight"]
        out[f"{theirs}post_attention_layernorm.weight"] = t[f"{ours}moe_norm.weight"]
        if kind == "F":
            q, k, v = t[f"{ours}wqkv.weight"].split([h * d, hkv * d, hkv * d])
            # transformers' q_proj holds each head's query, then its output gate: [H, 2 D, hidden]
            gated = torch.cat([q.view(h, d, -1), t[f"{ours}wgate.weight"].view(h, d, -1)], dim=1)
            out[f"{theirs}self_attn.q_proj.weight"] = gated.reshape(2 * h * d, -1)
            out[f"{theirs}self_attn.k_proj.weight"], out[f"{theirs}self_attn.v_proj.weight"] = k, v
            out[f"{theirs}self_attn.o_proj.weight"] = t[f"{ours}wo.weight"]
            out[f"{theirs}self_attn.q_norm.weight"] = t[f"{ours}q_norm.weight"]
            out[f"{theirs}self_attn.k_norm.weight"] = t[f"{ours}k_norm.weight"]
        else:
            m, a = f"{ours}mixer.", f"{theirs}linear_attn."
            q, k, v, z, av, bv = t[m + "w_in.weight"].split([hk * dk, hk * dk, hv * dv, hv * dv, hv, hv])
            # transformers groups its projections by key head: [q_h, k_h, its r value heads' v, then z]
            # and [its r value heads' b, then a]
            groups = [x.view(hk, -1, x.shape[-1]) for x in (q, k, v, z)]
            out[a + "in_proj_qkvz.weight"] = torch.cat(groups, dim=1).reshape(-1, q.shape[-1])
            out[a + "in_proj_ba.weight"] = torch.cat([bv.view(hk, r, -1), av.view(hk, r, -1)], dim=1).reshape(-1, q.shape[-1])
            out[a + "conv1d.weight"] = t[m + "conv"].unsqueeze(1)
            out[a + "A_log"], out[a + "dt_bias"] = t[m + "A_log"], t[m + "dt_bias"]
            out[a + "norm.weight"] = t[m + "norm"]
            out[a + "out_proj.weight"] = t[m + "w_out.weight"]
        moe, mlp = f"{ours}moe.", f"{theirs}mlp."
        out[mlp + "gate.weight"] = t[moe + "router.weight"]
        # the checkpoint holds each expert's projections apart (transformers fuses them as it loads)
        for ours_w, theirs_w in SWIGLU:
            for e, w in enumerate(t[f"{moe}experts.{ours_w}"]):
                out[f"{mlp}experts.{e}.{theirs_w}.weight"] = w.T
            out[f"{mlp}shared_expert.{theirs_w}.weight"] = t[f"{moe}shared.{ours_w}"].T
        out[mlp + "shared_expert_gate.weight"] = t[moe + "shared_gate.weight"]
    return out


def _qwen3_next_from_hf(cfg: ModelConfig, t: dict) -> dict:
    h, d = cfg.n_heads, cfg.head_dim
    p = cfg.sparse_params
    hk, hv, dk, dv = p["k_heads"], p["v_heads"], p["head_k_dim"], p["head_v_dim"]
    r = hv // hk
    out = _root_from_hf(cfg, _checked(t, to_hf(cfg, _shapes_only(cfg)).keys()))
    for i, kind in enumerate(cfg.layer_types):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out[f"{ours}attn_norm.weight"] = t.pop(f"{theirs}input_layernorm.weight")
        out[f"{ours}moe_norm.weight"] = t.pop(f"{theirs}post_attention_layernorm.weight")
        if kind == "F":
            gated = t.pop(f"{theirs}self_attn.q_proj.weight").view(h, 2 * d, -1)
            k, v = t.pop(f"{theirs}self_attn.k_proj.weight"), t.pop(f"{theirs}self_attn.v_proj.weight")
            out[f"{ours}wqkv.weight"] = torch.cat([gated[:, :d].reshape(h * d, -1), k, v])
            out[f"{ours}wgate.weight"] = gated[:, d:].reshape(h * d, -1).contiguous()
            out[f"{ours}wo.weight"] = t.pop(f"{theirs}self_attn.o_proj.weight")
            out[f"{ours}q_norm.weight"] = t.pop(f"{theirs}self_attn.q_norm.weight")
            out[f"{ours}k_norm.weight"] = t.pop(f"{theirs}self_attn.k_norm.weight")
        else:
            m, a = f"{ours}mixer.", f"{theirs}linear_attn."
            qkvz = t.pop(a + "in_proj_qkvz.weight").view(hk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)
            ba = t.pop(a + "in_proj_ba.weight").view(hk, 2 * r, -1)
            bv, av = ba.split([r, r], dim=1)
            parts = [x.reshape(-1, x.shape[-1]) for x in (q, k, v, z, av, bv)]
            out[m + "w_in.weight"] = torch.cat(parts)
            out[m + "conv"] = t.pop(a + "conv1d.weight").squeeze(1)
            out[m + "A_log"], out[m + "dt_bias"] = t.pop(a + "A_log"), t.pop(a + "dt_bias")
            out[m + "norm"] = t.pop(a + "norm.weight")
            out[m + "w_out.weight"] = t.pop(a + "out_proj.weight")
        moe, mlp = f"{ours}moe.", f"{theirs}mlp."
        out[moe + "router.weight"] = t.pop(mlp + "gate.weight")
        for ours_w, theirs_w in SWIGLU:
            out[f"{moe}experts.{ours_w}"] = torch.stack([t.pop(f"{mlp}experts.{e}.{theirs_w}.weight").T for e in range(cfg.n_experts)])
            out[f"{moe}shared.{ours_w}"] = t.pop(f"{mlp}shared_expert.{theirs_w}.weight").T.contiguous()
        out[moe + "shared_gate.weight"] = t.pop(mlp + "shared_expert_gate.weight")
    return out


def _kimi_linear_to_hf(cfg: ModelConfig, t: dict) -> dict:
    p = cfg.sparse_params
    hv, dk, dv, rank = p["v_heads"], p["head_k_dim"], p["head_v_dim"], p["gate_rank"]
    qk = p["k_heads"] * dk
    out = _root_to_hf(cfg, t)
    for i, kind in enumerate(cfg.layer_types):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        a = f"{theirs}self_attn."
        out[f"{theirs}input_layernorm.weight"] = t[f"{ours}attn_norm.weight"]
        out[f"{theirs}post_attention_layernorm.weight"] = t[f"{ours}moe_norm.weight"]
        if kind == "F":  # MLA
            for mine, name in _mla(cfg):
                if f"{ours}{mine}" in t:
                    out[a + name] = t[f"{ours}{mine}"]
        else:  # KDA
            m = f"{ours}mixer."
            q, k, v, g_a, f_a, b = t[m + "w_in.weight"].split([qk, qk, hv * dv, rank, rank, hv])
            out |= {a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v, a + "b_proj.weight": b}
            out |= {a + "g_a_proj.weight": g_a, a + "f_a_proj.weight": f_a}
            out[a + "g_b_proj.weight"], out[a + "f_b_proj.weight"] = t[m + "g_b.weight"], t[m + "f_b.weight"]
            for conv, x in zip(("q", "k", "v"), t[m + "conv"].split([qk, qk, hv * dv])):
                out[f"{a}{conv}_conv1d.weight"] = x.unsqueeze(1)
            out[a + "A_log"] = t[m + "A_log"].view(1, 1, hv, 1)
            out[a + "dt_bias"] = t[m + "dt_bias"].reshape(hv * dk)
            out[a + "o_norm.weight"], out[a + "o_proj.weight"] = t[m + "norm"], t[m + "w_out.weight"]
        mlp = f"{theirs}block_sparse_moe."  # transformers writes the dense block's SwiGLU under this name too
        if i < cfg.first_dense_layers:
            for ours_w, theirs_w in SWIGLU:
                out[f"{mlp}{theirs_w}.weight"] = t[f"{ours}mlp.{ours_w}"].T
            continue
        moe = f"{ours}moe."
        out[mlp + "gate.weight"] = t[moe + "router.weight"]
        if moe + "score_bias" in t:  # a buffer: in a state dict, not among the gradients
            out[mlp + "gate.e_score_correction_bias"] = t[moe + "score_bias"]
        for ours_w, theirs_w in SWIGLU:
            for e, w in enumerate(t[f"{moe}experts.{ours_w}"]):  # the checkpoint's expert names: w1, w3, w2 as the project's
                out[f"{mlp}experts.{e}.{ours_w}.weight"] = w.T
            out[f"{mlp}shared_experts.{theirs_w}.weight"] = t[f"{moe}shared.{ours_w}"].T
    return out


def _kimi_linear_from_hf(cfg: ModelConfig, t: dict) -> dict:
    p = cfg.sparse_params
    hv, dk = p["v_heads"], p["head_k_dim"]
    # transformers' model holds the dense block's SwiGLU as mlp.*, its save_pretrained writes block_sparse_moe.*: both load
    t = t.renamed(lambda k: k.replace(".mlp.", ".block_sparse_moe."))
    out = _root_from_hf(cfg, _checked(t, to_hf(cfg, _shapes_only(cfg)).keys()))
    for i, kind in enumerate(cfg.layer_types):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        a = f"{theirs}self_attn."
        out[f"{ours}attn_norm.weight"] = t.pop(f"{theirs}input_layernorm.weight")
        out[f"{ours}moe_norm.weight"] = t.pop(f"{theirs}post_attention_layernorm.weight")
        if kind == "F":
            for mine, name in _mla(cfg):
                if a + name in t:
                    out[f"{ours}{mine}"] = t.pop(a + name)
        else:
            m = f"{ours}mixer."
            names = ("q_proj", "k_proj", "v_proj", "g_a_proj", "f_a_proj", "b_proj")
            out[m + "w_in.weight"] = torch.cat([t.pop(f"{a}{n}.weight") for n in names])
            out[m + "g_b.weight"], out[m + "f_b.weight"] = t.pop(a + "g_b_proj.weight"), t.pop(a + "f_b_proj.weight")
            out[m + "conv"] = torch.cat([t.pop(f"{a}{c}_conv1d.weight") for c in "qkv"]).squeeze(1)
            out[m + "A_log"] = t.pop(a + "A_log").reshape(hv)
            out[m + "dt_bias"] = t.pop(a + "dt_bias").reshape(hv, dk)
            out[m + "norm"], out[m + "w_out.weight"] = t.pop(a + "o_norm.weight"), t.pop(a + "o_proj.weight")
        mlp = f"{theirs}block_sparse_moe."
        if i < cfg.first_dense_layers:
            for ours_w, theirs_w in SWIGLU:
                out[f"{ours}mlp.{ours_w}"] = t.pop(f"{mlp}{theirs_w}.weight").T.contiguous()
            continue
        moe = f"{ours}moe."
        out[moe + "router.weight"] = t.pop(mlp + "gate.weight")
        out[moe + "score_bias"] = t.pop(mlp + "gate.e_score_correction_bias")
        for ours_w, theirs_w in SWIGLU:
            out[f"{moe}experts.{ours_w}"] = torch.stack([t.pop(f"{mlp}experts.{e}.{ours_w}.weight").T for e in range(cfg.n_experts)])
            out[f"{moe}shared.{ours_w}"] = t.pop(f"{mlp}shared_experts.{theirs_w}.weight").T.contiguous()
    return out


def _mla(cfg: ModelConfig) -> list[tuple[str, str]]:
    """MLA's tensors (model.hybrid.LatentProjections): the project's name in a block, transformers'
    in its self_attn; the biases among them are there where the model has them."""
    query = [("latent.wq", "q_proj")] if cfg.q_lora_rank is None else [
        ("latent.wq_a", "q_a_proj"), ("latent.q_norm", "q_a_layernorm"), ("latent.wq", "q_b_proj")
    ]  # fmt: skip
    parts = [
        *query,
        ("latent.wkv_a", "kv_a_proj_with_mqa"),
        ("latent.kv_norm", "kv_a_layernorm"),
        ("latent.wkv_b", "kv_b_proj"),
        ("wo", "o_proj"),
    ]
    return [(f"{ours}.{kind}", f"{theirs}.{kind}") for ours, theirs in parts for kind in ("weight", "bias")]


def _shapes_only(cfg: ModelConfig) -> dict:
    """The project's names of cfg's model, each a placeholder (to list transformers' names)."""
    from .hybrid import HybridMoE  # noqa: PLC0415 (the model imports nothing of this module)

    with torch.device("meta"):
        return dict(HybridMoE(cfg).state_dict())


def _checked(t: dict, expected) -> dict:
    """t, once every name transformers' model of cfg has is in it and nothing else is."""
    expected = set(expected)
    missing, extra = sorted(expected - set(t)), sorted(set(t) - expected)
    if missing or extra:
        raise SettingError(
            f"the checkpoint's tensors do not match the model: missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, "
            f"left over {extra[:4]}{' ...' if len(extra) > 4 else ''}"
        )
    return t


ADAPTERS = {
    "gpt_oss": (_gpt_oss_to_hf, _gpt_oss_from_hf),
    "qwen3_next": (_qwen3_next_to_hf, _qwen3_next_from_hf),
    "kimi_linear": (_kimi_linear_to_hf, _kimi_linear_from_hf),
}


def read_checkpoint(folder: str) -> Tensors:
    """Every tensor of a Hugging Face checkpoint, each read when taken: DIR/model.safetensors, or
    the files its index (model.safetensors.index.json) lists; SettingError naming what is missing."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, WEIGHTS)):
        files = [WEIGHTS]
    else:
        raise SettingError(f"--init-from hf:{folder}: no {WEIGHTS} or {INDEX} in it (a Hugging Face checkpoint's weights)")
    return Tensors.files([os.path.join(folder, name) for name in files])


class _IntoModel:
    """load_hf's `into`: each of the project's tensors, as the adapter makes it, cast to the
    model's dtype, cut to the rank's expert-parallel slot (experts) and copied into the rank's part
    of the parameter or buffer (its FSDP2 shard: torch's distribute_tensor cuts the local part of
    the full tensor every rank holds alike, no communication), then dropped."""

    def __init__(self, model):
        self.targets = dict(model.state_dict(keep_vars=True))
        held = next(m for m in model.modules() if isinstance(m, Experts))  # every block holds the same slot
        self.slot = slice(held.first, held.first + held.count) if held.count < model.cfg.n_experts else None

    def __setitem__(self, name: str, full: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: PLC0415

        target = self.targets.pop(name)  # the adapter makes each once (_checked holds its names to the model's)
        if self.slot is not None and ".moe.experts." in name:
            full = full[self.slot]
        full = full.to(target.dtype)
        with torch.no_grad():
            if isinstance(target, DTensor):
                target.copy_(distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None))
            else:
                target.copy_(full)

    def check_done(self, folder: str) -> None:
        if self.targets:
            raise InternalError(f"--init-from {folder}: the adapter left {sorted(self.targets)[:4]} of the model unset")


def load_hf(model, folder: str) -> None:
    """The weights of the Hugging Face checkpoint in `folder` into `model` (HybridMoE, replicated or
    sharded by FSDP2, its experts split over an expert-parallel group or not), one tensor at a time:
    every rank reads each tensor of the file as the adapter takes it (read_checkpoint), converts it
    (from_hf) and copies its expert-parallel slot's experts and its FSDP2 shard into the model
    (_IntoModel): a rank holds the block it converts, not the checkpoint."""
    cfg = model.cfg
    tensors, left, what = unbuilt(cfg, read_checkpoint(folder))
    if left and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"--init-from {folder}: {len(left)} tensors of {what} ({left[0]}, ...) left out: the project neither prices nor trains it")
    into = _IntoModel(model)
    from_hf(cfg, tensors, into)
    into.check_done(folder)


SHARD_BYTES = 5 << 30  # a written file's size at most (one tensor larger stands alone), as transformers' save_pretrained shards


def save_hf(model, folder: str, shard_bytes: int = SHARD_BYTES) -> None:
    """`model`'s weights as a Hugging Face checkpoint in `folder` (config.json from its settings,
    config.hf.to_hf_dict; to_hf's names and layout), a tensor at a time: collective, every rank
    takes part in making each tensor whole (FSDP2's shards gathered; the other expert-parallel
    slots' experts sent to rank 0 by the ranks 1..ep-1 that hold them) as the adapter asks for it,
    and rank 0 hands each of the adapter's tensors to _Shards, which writes a file whenever it
    holds shard_bytes: model.safetensors where one file holds them all, else transformers' shards
    and their index. Rank 0 holds a file's worth and one block, the other ranks a tensor."""
    cfg = model.cfg
    config = to_hf_dict(cfg)  # first: a model it cannot write fails before any collective
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    into = _Shards(folder, shard_bytes, rank0)
    to_hf(cfg, _whole_tensors(model, rank0), into)
    into.close()
    if dist.is_initialized():
        dist.barrier()


def _whole_tensors(model, rank0: bool) -> Tensors:
    """The model's tensors by name, each made whole when the adapter asks for it (every rank asks
    in the same order: each is a collective), on rank 0; elsewhere a placeholder of its shape."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    state = get_model_state_dict(model) if dist.is_initialized() else model.state_dict()
    ep = getattr(model, "ep", 1)

    def whole(name):
        v = state[name]
        v = (v.full_tensor() if isinstance(v, DTensor) else v).detach()
        if ep > 1 and ".moe.experts." in name:  # rank r holds slot r mod ep: ranks 1..ep-1 send theirs to rank 0
            rank = dist.get_rank()
            if rank0:
                parts = [v] + [torch.empty_like(v) for _ in range(1, ep)]
                for src in range(1, ep):
                    dist.recv(parts[src], src=src)
                v = torch.cat(parts)
            else:
                if rank < ep:
                    dist.send(v.contiguous(), dst=0)
                v = v.new_empty((v.shape[0] * ep, *v.shape[1:]), device="meta")
        return v.cpu().contiguous() if rank0 else v.to("meta")

    return Tensors({name: (lambda name=name: whole(name)) for name in state})


class _Shards:
    """save_hf's `into`: the adapter's tensors, written by rank 0 into files of at most shard_bytes
    (a larger tensor alone) as they come; close() names them as transformers does (one file:
    model.safetensors; several: model-0000i-of-0000n.safetensors and their index). Elsewhere: nothing."""

    def __init__(self, folder: str, shard_bytes: int, rank0: bool):
        self.folder, self.shard_bytes, self.rank0 = folder, shard_bytes, rank0
        self.held: dict[str, torch.Tensor] = {}
        self.held_bytes = self.total = 0
        self.files: list[tuple[str, list[str]]] = []  # (temporary path, its tensors' names)

    def __setitem__(self, name: str, t: torch.Tensor) -> None:
        if not self.rank0:
            return
        size = t.numel() * t.element_size()
        if self.held and self.held_bytes + size > self.shard_bytes:
            self._write()
        self.held[name] = t.contiguous()
        self.held_bytes += size
        self.total += size

    def __ior__(self, tensors: dict) -> _Shards:
        for name, t in tensors.items():
            self[name] = t
        return self

    def _write(self) -> None:
        from safetensors.torch import save_file  # noqa: PLC0415

        path = os.path.join(self.folder, f".part-{len(self.files)}.safetensors")
        save_file(self.held, path, metadata={"format": "pt"})
        self.files.append((path, list(self.held)))
        self.held, self.held_bytes = {}, 0

    def close(self) -> None:
        if not self.rank0:
            return
        if self.held or not self.files:
            self._write()
        n = len(self.files)
        names = [WEIGHTS] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for (path, _), name in zip(self.files, names):
            os.replace(path, os.path.join(self.folder, name))
        if n > 1:
            weight_map = {t: name for (_, held), name in zip(self.files, names) for t in held}
            with open(os.path.join(self.folder, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
