"""Tiny random configs of the three Hugging Face families the project reads (config.hf), built by
transformers' own config classes: the yardstick its tests hold the project to. transformers is
imported here only (a test dependency, requirements.txt)."""

from __future__ import annotations

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
            num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, num_local_experts=4,
            num_experts_per_tok=2, linear_head_dim=8, linear_num_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
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


def tiny_hf_model(family: str, seed: int = 0, **changes):
    """transformers' causal LM of tiny_hf_config(family), its weights drawn with `seed`."""
    import torch
    import transformers

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
