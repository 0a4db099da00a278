"""Tiny random configs of the three Hugging Face families the project reads (config.hf), built by
transformers' own config classes: the yardstick its tests hold the project to. transformers is
imported here only (a test dependency, requirements.txt)."""

from __future__ import annotations

import contextlib

FAMILIES = ("qwen3_next", "kimi_linear", "gpt_oss")


def tiny_hf_config(family: str, **changes):
    """A transformers config of `family`, small enough for a CPU step: 4 or 5 layers of hidden 64,
    4 experts routed 2 a token, a vocabulary of 97; its experts on transformers' eager path, which
    runs in float64 (its grouped-matmul path refuses it)."""
    import transformers

    shapes = {
        "qwen3_next": dict(
            vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=24,
        ),
        "kimi_linear": dict(
            vocab_size=97, hidden_size=64, intermediate_size=48, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, num_local_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, linear_head_dim=8, linear_num_heads=4, pad_token_id=0, bos_token_id=1,
            eos_token_id=2,
        ),
        "gpt_oss": dict(
            vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        ),
    }  # fmt: skip
    classes = {
        "qwen3_next": transformers.Qwen3NextConfig,
        "kimi_linear": transformers.KimiLinearConfig,
        "gpt_oss": transformers.GptOssConfig,
    }
    if family not in classes:
        raise ValueError(f"family {family!r}; valid: {FAMILIES}")
    cfg = classes[family](**{**shapes[family], **changes})
    cfg._experts_implementation = "eager"
    return cfg


def torch_reference_paths() -> None:
    """transformers' own torch forms of the linear layers' kernels, on CPU: where fla-core is
    installed (a dependency here) transformers 5.24 binds its chunked Triton kernel at import,
    whatever the device, and Triton has no CPU driver. Rebinds each model module's name to the
    torch function the binding wrapped (its kwargs filtered to that function's, as the binding
    does). Idempotent."""
    import inspect

    from transformers.models.kimi_linear import modeling_kimi_linear
    from transformers.models.qwen3_next import modeling_qwen3_next

    for module, names in (
        (modeling_qwen3_next, ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")),
        (modeling_kimi_linear, ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")),
    ):
        for name in names:
            bound = getattr(module, name)
            raw = inspect.unwrap(bound)
            if raw is bound:
                continue
            setattr(module, name, taking_its_own(raw))


def taking_its_own(fn):
    """fn, called with only the keyword arguments of its own signature (as transformers' kernel
    binding calls the function it wraps: the model passes more, cu_seqlens among them)."""
    import inspect

    params = set(inspect.signature(fn).parameters)
    return lambda *a, **k: fn(*a, **{x: v for x, v in k.items() if x in params})


def drawn_hf_model(family: str, seed: int = 0, dtype=None, **changes):
    """tiny_hf_model(family) in `dtype` (as built where None) with every weight drawn from N(0, 0.2^2)
    (seed + 1): its biases, sinks and norms too, which transformers starts at constants, and Kimi
    Linear's routing bias (a buffer, e_score_correction_bias), which it starts at zero."""
    import torch

    model = tiny_hf_model(family, seed, **changes)
    model = model if dtype is None else model.to(dtype)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.2)
    return model


def tiny_hf_model(family: str, seed: int = 0, **changes):
    """transformers' causal LM of tiny_hf_config(family), its weights drawn with `seed` (its
    linear layers on transformers' torch forms: torch_reference_paths)."""
    import torch
    import transformers

    torch_reference_paths()

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_hf_config(family, **changes))


def priced_params(model) -> tuple[int, int]:
    """(every parameter the cost model counts, the routed experts' among them) of a transformers
    model: its matrices (embeddings, projections, routers, experts), less what the cost model
    leaves out by design (norms, convolutions, a linear layer's decay and bias, biases, sinks)."""
    skip = ("norm", "conv1d", "A_log", "dt_bias", "bias", "sinks")
    total = experts = 0
    for name, p in model.named_parameters():
        if any(s in name for s in skip):
            continue
        total += p.numel()
        if ".experts." in name and "shared" not in name:
            experts += p.numel()
    return total, experts


def _in_float64(source: str) -> str:
    """transformers' source of a function or class with every float32 it computes in made float64."""
    for a, b in ((".float()", ".double()"), ("torch.float32", "torch.float64"), ("dtype=torch.float)", "dtype=torch.float64)")):
        source = source.replace(a, b)
    return source


def _rebuilt_in_float64(module, names: dict[str, str]) -> dict:
    """Each function ("def") or class ("class") of transformers' `module` named in `names`, rebuilt
    from its own source with float32 made float64 (its decorators, which bind hub kernels, left
    off), by name."""
    import re

    src = open(module.__file__).read()
    ns = dict(module.__dict__)
    for name, kw in names.items():
        found = re.search(rf"^(?:@[^\n]*\n)*{kw} {name}\b.*?(?=^(?:def |class |@))", src, re.S | re.M)
        body = re.sub(r"^@.*\n", "", found.group(0), flags=re.M)
        exec(compile(_in_float64(body), module.__file__, "exec"), ns)
    return {n: ns[n] for n in names}


@contextlib.contextmanager
def _patched(module, values: dict):
    saved = {n: getattr(module, n) for n in values}
    try:
        for n, v in values.items():
            setattr(module, n, v)
        yield
    finally:
        for n, v in saved.items():
            setattr(module, n, v)


@contextlib.contextmanager
def kimi_linear_in_float64():
    """transformers' Kimi Linear as it is, but computing in float64 where its code computes in
    float32 whatever the model's dtype: its chunked KDA rule, its RMSNorms (plain and gated), its
    forget gate, its router (logits, sigmoid and weights) and its eager attention's softmax, each
    rebuilt from its own source with float32 made float64. Build the model inside."""
    from transformers.models.kimi_linear import modeling_kimi_linear as mk

    torch_reference_paths()
    names = {"chunk_kimi_delta_attention": "def", "eager_attention_forward": "def", "KimiLinearRMSNorm": "class",
             "KimiLinearRMSNormGated": "class", "KimiLinearForgetGate": "class", "KimiLinearTopkRouter": "class"}  # fmt: skip
    patched = _rebuilt_in_float64(mk, names)
    patched["chunk_kimi_delta_attention"] = taking_its_own(patched["chunk_kimi_delta_attention"])
    with _patched(mk, patched):
        yield


@contextlib.contextmanager
def qwen3_next_in_float64():
    """transformers' Qwen3-Next as it is, but computing in float64 where its code computes in
    float32 whatever the model's dtype: its chunked Gated DeltaNet rule, its RMSNorms (plain and
    gated) and its rotary angles, each rebuilt from its own source with float32 made float64 (the
    router's softmax, the decay's softplus and the attention's softmax stay float32). Build the
    model inside: its rotary frequencies are computed as it is made."""
    from transformers.models.qwen3_next import modeling_qwen3_next as mq

    torch_reference_paths()
    names = {"torch_chunk_gated_delta_rule": "def", "Qwen3NextRMSNorm": "class", "Qwen3NextRMSNormGated": "class",
             "Qwen3NextRotaryEmbedding": "class"}  # fmt: skip
    patched = _rebuilt_in_float64(mq, names)
    patched["torch_chunk_gated_delta_rule"] = taking_its_own(patched["torch_chunk_gated_delta_rule"])
    with _patched(mq, patched):
        yield
