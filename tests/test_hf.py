"""Hugging Face models priced as transformers builds them (config.hf, `--model hf:DIR`): each
family's tiny random config read into the model section, its parameters counted by the cost model
against transformers' own model of that config, the shipped flagship configs held to transformers'
reading of them and to their model cards, and what cannot be priced or built refused by name."""

from __future__ import annotations

import contextlib
import csv
import json
import os

import pytest
import torch
from hf_utils import FAMILIES, drawn_hf_model, kimi_linear_in_float64, priced_params, qwen3_next_in_float64, tiny_hf_config, tiny_hf_model

from config import HardwareConfig, ModelConfig, SettingError, read_hf_config
from config.hf import HF_MODELS
from solver import CostModel

pytest.importorskip("transformers")

LAYER_LETTER = {"full_attention": "F", "linear_attention": "S", "sliding_attention": "S"}
KIND = {"qwen3_next": "gated_delta", "kimi_linear": "kda", "gpt_oss": "sliding_window"}
# each flagship's model card: layers, routed experts, experts a token, shared experts' width, and
# total parameters in billions (cards round to whole billions and differ on counting embeddings)
CARDS = {
    "qwen3-next-80b-a3b": (48, 512, 10, 512, 80),
    "kimi-linear-48b-a3b": (27, 256, 8, 1024, 48),
    "gpt-oss-120b": (36, 128, 4, 0, 117),
}


def saved(tmp_path, family, **changes) -> str:
    """A folder holding the config.json transformers writes for the tiny config of `family`."""
    tiny_hf_config(family, **changes).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_tiny_config_reads_with_transformers_layers_heads_and_experts(tmp_path, family):
    hf = tiny_hf_config(family)
    m = read_hf_config(saved(tmp_path, family))
    assert m.architecture == family and m.sparse_kind == KIND[family]
    assert m.layer_types == "".join(LAYER_LETTER[t] for t in hf.layer_types)
    assert (m.n_layers, m.hidden, m.n_heads, m.vocab) == (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.vocab_size)
    assert (m.n_experts, m.top_k) == (hf.num_local_experts if family != "qwen3_next" else hf.num_experts, hf.num_experts_per_tok)
    dense = getattr(hf, "mlp_layer_types", None) or []
    assert m.first_dense_layers == dense.count("dense")


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_cost_model_counts_every_parameter_transformers_builds(tmp_path, family):
    """The cost model's total and routed-expert parameters equal transformers' model's, matrix by
    matrix (its shared experts and their gate, the dense first block, MLA's latents, the gated
    query): only what it leaves out by design (norms, convolutions, biases, sinks) is left out."""
    model = tiny_hf_model(family)
    cost = CostModel(read_hf_config(saved(tmp_path, family)), HardwareConfig())
    total, experts = priced_params(model)
    assert cost.total_params() == total
    assert cost.expert_params() == experts


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_active_parameters_are_transformers_less_the_experts_a_token_skips(tmp_path, family):
    model = tiny_hf_model(family)
    m = read_hf_config(saved(tmp_path, family))
    total, experts = priced_params(model)
    embedding = model.get_input_embeddings().weight.numel()  # a lookup: no FLOPs
    expected = total - embedding - experts * (m.n_experts - m.top_k) / m.n_experts
    assert CostModel(m, HardwareConfig()).active_params() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_fsdp_holds_every_parameter_and_norm_of_transformers_model_on_one_rank(tmp_path, family):
    """sharded_params on one rank (no padding) holds the priced parameters and each block's two
    norms and the final norm, the weights FSDP2 gathers, counted from transformers' model."""
    model = tiny_hf_model(family)
    m = read_hf_config(saved(tmp_path, family))
    total, _ = priced_params(model)
    norms = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")))
    norms += model.model.norm.weight.numel()
    assert sum(CostModel(m, HardwareConfig()).sharded_params(1)) == total + norms


@pytest.mark.parametrize("name", sorted(CARDS))
def test_hf_shipped_flagship_loads_in_transformers_with_the_layers_the_project_reads(name):
    from transformers import AutoConfig

    folder = os.path.join(HF_MODELS, name)
    hf, m = AutoConfig.from_pretrained(folder), ModelConfig.from_name(name)
    assert m.layer_types == "".join(LAYER_LETTER[t] for t in hf.layer_types)
    assert m.first_dense_layers == (getattr(hf, "mlp_layer_types", None) or []).count("dense")
    assert ModelConfig.from_name(f"hf:{folder}").replace(name=name) == m


@pytest.mark.parametrize("name", sorted(CARDS))
def test_hf_shipped_flagship_matches_its_model_card(name):
    layers, experts, top_k, shared, billions = CARDS[name]
    m = ModelConfig.from_name(name)
    assert (m.n_layers, m.n_experts, m.top_k, m.shared_expert_ffn) == (layers, experts, top_k, shared)
    assert CostModel(m, HardwareConfig()).total_params() / 1e9 == pytest.approx(billions, rel=0.03)


def test_hf_checkpoint_spellings_read_as_transformers_own(tmp_path):
    """Kimi Linear's checkpoint spelling (linear_attn_config's 1-based layer lists,
    first_k_dense_replace) and Qwen3-Next's (full_attention_interval) read as transformers' own
    spelling of the same model (layer_types, mlp_layer_types)."""
    kimi = tiny_hf_config("kimi_linear", num_hidden_layers=7).to_dict()
    full = [i + 1 for i, t in enumerate(kimi["layer_types"]) if t == "full_attention"]
    ckpt = {k: v for k, v in kimi.items() if k not in ("layer_types", "mlp_layer_types")}
    ckpt["linear_attn_config"] = {
        "full_attn_layers": full,
        "kda_layers": [i for i in range(1, 8) if i not in full],
        "num_heads": 4,
        "head_dim": 8,
    }
    ckpt["first_k_dense_replace"] = 1
    qwen = tiny_hf_config("qwen3_next", num_hidden_layers=8).to_dict()
    qwen_ckpt = {k: v for k, v in qwen.items() if k != "layer_types"} | {"full_attention_interval": 4}
    for own, other in ((kimi, ckpt), (qwen, qwen_ckpt)):
        for i, raw in enumerate((own, other)):
            (tmp_path / str(i)).mkdir(exist_ok=True)
            (tmp_path / str(i) / "config.json").write_text(json.dumps(raw))
        assert read_hf_config(str(tmp_path / "0"), name="x") == read_hf_config(str(tmp_path / "1"), name="x")


@pytest.mark.parametrize(
    "family, change, named",
    [
        ("qwen3_next", {"num_nextn_predict_layers": 1}, "num_nextn_predict_layers=1: a multi-token-prediction head"),
        ("qwen3_next", {"mlp_only_layers": [2]}, "blocks [2] dense"),
        ("qwen3_next", {"use_sliding_window": True}, "use_sliding_window=true"),
        ("kimi_linear", {"moe_layer_freq": 2}, "moe_layer_freq=2"),
        ("gpt_oss", {"model_type": "llama"}, "model_type='llama' is not a family the project reads"),
        ("gpt_oss", {"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "layer_types[1]='chunked_attention'"),
    ],
)
def test_hf_refuses_what_it_cannot_price_naming_it(tmp_path, family, change, named):
    raw = tiny_hf_config(family).to_dict() | change
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(SettingError, match=named.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        read_hf_config(f"hf:{tmp_path}")


def test_hf_a_folder_without_a_config_is_refused_naming_the_file(tmp_path):
    with pytest.raises(SettingError, match=r"no .*config\.json"):
        ModelConfig.from_name(f"hf:{tmp_path}")


def test_hf_model_flag_runs_the_ablation_as_the_shipped_preset(tmp_path):
    """`--model hf:DIR` on the ablation prices the config it reads: the same rows as the preset
    read from that file at import (a small cluster and few steps)."""
    from experiments.ablation.__main__ import main

    args = ["--world-size", "16", "--gpus-per-node", "4", "--tokens-per-rank", "8192", "--steps", "12", "--seeds", "1", "--no-progress"]
    rows = {}
    for spec in ("qwen3-next-80b-a3b", f"hf:{os.path.join(HF_MODELS, 'qwen3-next-80b-a3b')}"):
        out = tmp_path / str(len(rows))
        main(["--model", spec, *args, "--out", str(out)])
        summary = json.loads((out / "summary.json").read_text())
        assert summary["config"]["model"]["architecture"] == "qwen3_next"
        with open(out / "steps.csv") as f:  # every column but the planner's measured time
            rows[spec] = [(r["mode"], r["step"], r["plan_hash"], r["step_time_s"], r["model_flops"]) for r in csv.DictReader(f)]
    first, second = rows.values()
    assert first == second and len(first) > 0


def test_hf_training_refuses_a_feature_the_runtime_does_not_build(tmp_path):
    from model.hybrid import HybridMoE

    kimi = read_hf_config(saved(tmp_path, "kimi_linear"))
    with pytest.raises(SettingError, match=r"does not build MLA with a rotary part"):
        HybridMoE(kimi.replace(rotary_dim=None))
    with pytest.raises(SettingError, match=r"does not build q/k head norms on MLA's heads"):
        HybridMoE(kimi.replace(qk_norm=True))
    with pytest.raises(SettingError, match=r"does not build the gated attention output with value heads of another size"):
        HybridMoE(ModelConfig.from_name("tiny", attn_output_gate=True, v_head_dim=4))
    with pytest.raises(SettingError, match=r"does not build unknown's blocks"):
        HybridMoE(ModelConfig.from_name("tiny", architecture="unknown"))


BUILT = FAMILIES  # the families whose blocks the runtime builds: all three


def hf_pair(tmp_path, family: str, seed: int = 0, **changes):
    """transformers' tiny model of `family` with every weight drawn (biases, sinks, norms too),
    saved as safetensors in tmp_path, and the project's model of its config loaded from that
    file, both float64."""
    from safetensors.torch import load_file

    from model.hf import from_hf
    from model.hybrid import HybridMoE

    theirs = drawn_hf_model(family, seed, torch.float64, **changes)
    theirs.save_pretrained(tmp_path)
    cfg = read_hf_config(str(tmp_path))
    ours = HybridMoE(cfg).double()
    ours.load_state_dict(from_hf(cfg, load_file(str(tmp_path / "model.safetensors"))))
    return theirs, ours, cfg


@pytest.mark.parametrize("family", BUILT)
def test_hf_logits_and_gradients_match_transformers(tmp_path, family):
    """The project's model and transformers', loaded from the same safetensors, on two samples
    (packed in ours, one at a time in theirs; longer than gpt-oss's window): the same logits and
    the same gradient of the next-token loss for every weight, float64. gpt-oss (with YaRN's
    rotary scaling) within 1e-6: transformers computes its RMSNorm and its rotary angles in
    float32 whatever the model's dtype. Qwen3-Next (partial rotary, gated attention, q/k norms,
    zero-centered norms, Gated DeltaNet layers, a gated shared expert) within 2e-6, against
    transformers' model computing its Gated DeltaNet rule, its norms and its rotary angles in
    float64 (hf_utils.qwen3_next_in_float64: its own code with float32 made float64); its router's
    softmax, its decay's softplus and its attention's softmax stay float32 (measured here: 6e-7 on
    the logits and the gradients; 1.7e-5 on the logits and 2.6e-4 on a convolution's gradient with
    all of its float32). Kimi Linear (MLA with value heads of their own size and no rotary, KDA
    layers, a dense first block, a sigmoid router choosing among groups with its bias, scaled, a
    shared expert) within 1e-12, against transformers' model with every float32 of its code made
    float64 (hf_utils.kimi_linear_in_float64; measured here: 9e-16 on the logits, 2e-16 on the
    gradients; the routing bias left at zero or the scaling at 1 moves the logits by 0.5 or more)."""
    rebuilt = {"qwen3_next": qwen3_next_in_float64, "kimi_linear": kimi_linear_in_float64}.get(family, contextlib.nullcontext)
    with rebuilt():
        compare_with_transformers(tmp_path, family)


def compare_with_transformers(tmp_path, family: str) -> None:
    from model.hf import to_hf
    from model.hybrid import LocalPlacement

    yarn = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 8}
    changes = {"rope_parameters": {**yarn, "rope_theta": 1e4, "truncate": False}} if family == "gpt_oss" else {}
    theirs, ours, cfg = hf_pair(tmp_path, family, **changes)
    assert family != "gpt_oss" or cfg.rope_scaling["factor"] == 4.0
    lengths = [13, 9]
    g = torch.Generator().manual_seed(3)
    samples = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in lengths]
    tokens = torch.cat(samples)
    labels = torch.cat([torch.cat([s[1:], torch.tensor([-100])]) for s in samples])
    count = int((labels != -100).sum())
    place = LocalPlacement(lengths, cfg, "torch")
    h, _ = ours(tokens, place)
    mine = ours.logits(h)
    want = torch.cat([theirs(input_ids=s[None]).logits[0] for s in samples])
    tol = {"gpt_oss": 1e-6, "qwen3_next": 2e-6, "kimi_linear": 1e-12}[family]
    torch.testing.assert_close(mine, want, rtol=tol, atol=tol)

    ours.loss(tokens, labels, place, count).backward()
    ce = sum(torch.nn.functional.cross_entropy(theirs(input_ids=s[None]).logits[0, :-1], s[1:], reduction="sum") for s in samples)
    (ce / count).backward()
    from transformers.core_model_loading import revert_weight_conversion

    grads = to_hf(cfg, {n: p.grad for n, p in ours.named_parameters()})
    # theirs in the checkpoint's layout (Qwen3-Next's experts apart), as transformers saves them
    theirs_grads = revert_weight_conversion(theirs, {n: p.grad for n, p in theirs.named_parameters()})
    assert grads.keys() == theirs_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, theirs_grads[name], rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family", BUILT)
def test_hf_weights_round_trip_bit_exact(tmp_path, family):
    """project -> Hugging Face -> project gives every weight back bit for bit, and the Hugging
    Face names are exactly transformers' model's; a checkpoint missing a tensor is refused naming it."""
    from model.hf import from_hf, to_hf

    theirs, ours, cfg = hf_pair(tmp_path, family)
    from safetensors.torch import load_file

    out = to_hf(cfg, ours.state_dict())
    saved = load_file(str(tmp_path / "model.safetensors"))  # what transformers writes: the yardstick of the names
    assert out.keys() == saved.keys()
    for name, t in saved.items():
        assert torch.equal(out[name], t), name
    back = from_hf(cfg, out)
    for name, t in ours.state_dict().items():
        assert torch.equal(back[name], t), name
    del out["model.layers.1.post_attention_layernorm.weight"]
    with pytest.raises(SettingError, match=r"missing \['model.layers.1.post_attention_layernorm.weight'\]"):
        from_hf(cfg, out)


@pytest.mark.parametrize("family", BUILT)
def test_hf_save_writes_a_checkpoint_transformers_loads_with_the_same_logits(tmp_path, family):
    """model.hf.save_hf (one process) writes config.json and model.safetensors, or, with files of
    at most 40 kB, transformers' shards and their index: transformers reads the config as the
    project does (config.hf) and its model of either folder computes the logits of the original
    checkpoint's; load_hf reads the shards back bit for bit."""
    import json

    from transformers import AutoModelForCausalLM

    from model.hf import INDEX, WEIGHTS, load_hf, save_hf
    from model.hybrid import HybridMoE

    theirs, ours, cfg = hf_pair(tmp_path / "in", family)
    save_hf(ours, str(tmp_path / "out"))
    save_hf(ours, str(tmp_path / "shards"), shard_bytes=40_000)
    assert (tmp_path / "out" / WEIGHTS).is_file() and not (tmp_path / "out" / INDEX).exists()
    files = set(json.loads((tmp_path / "shards" / INDEX).read_text())["weight_map"].values())
    assert len(files) > 2 and files == {p.name for p in (tmp_path / "shards").glob("model-*-of-*.safetensors")}
    ids = torch.arange(11)[None] % cfg.vocab
    for folder in ("out", "shards"):
        assert read_hf_config(str(tmp_path / folder), name=cfg.name) == cfg
        again = AutoModelForCausalLM.from_pretrained(str(tmp_path / folder), experts_implementation="eager").double()
        torch.testing.assert_close(again(input_ids=ids).logits, theirs(input_ids=ids).logits, rtol=0, atol=0)
    back = HybridMoE(cfg).double()
    load_hf(back, str(tmp_path / "shards"))
    for name, t in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


def test_hf_load_leaves_out_qwen3_nexts_prediction_head_saying_so_and_nothing_else(tmp_path, capsys):
    """A Qwen3-Next checkpoint with its multi-token-prediction head (mtp.*, as published) loads,
    the head left out with a line naming it; any other tensor the model lacks is still refused."""
    from safetensors.torch import load_file, save_file

    from model.hf import load_hf
    from model.hybrid import HybridMoE

    theirs, ours, cfg = hf_pair(tmp_path, "qwen3_next")
    weights = load_file(str(tmp_path / "model.safetensors"))
    save_file({**weights, "mtp.fc.weight": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    fresh = HybridMoE(cfg).double()
    load_hf(fresh, str(tmp_path))
    assert "1 tensors of its multi-token-prediction head (mtp.fc.weight, ...) left out" in capsys.readouterr().out
    for name, t in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    save_file({**weights, "model.extra.weight": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(SettingError, match=r"left over \['model.extra.weight'\]"):
        load_hf(HybridMoE(cfg).double(), str(tmp_path))


@pytest.mark.parametrize("family", BUILT)
def test_hf_load_holds_one_block_of_the_checkpoint_at_a_time(tmp_path, family):
    """--init-from's loader streams (model.hf.load_hf): each tensor is read from the file when the
    adapter takes it and handed on converted, so the bytes taken and not yet handed on never exceed
    the largest block's (or the largest tensor outside the blocks), where reading the file first
    would hold the whole checkpoint; and the model it fills equals the one load_state_dict fills."""
    import re

    from safetensors.torch import load_file, save_file

    from model.hf import Tensors, from_hf, read_checkpoint
    from model.hybrid import HybridMoE

    theirs, ours, cfg = hf_pair(tmp_path, family)
    path = str(tmp_path / "model.safetensors")
    listed, weights = read_checkpoint(str(tmp_path)), load_file(path)
    save_file({**weights, "model.norm.weight": torch.zeros_like(weights["model.norm.weight"])}, path)
    assert not listed.pop("model.norm.weight").any()  # read when taken, not when listed
    save_file(weights, path)
    files = read_checkpoint(str(tmp_path))
    sizes = {}
    held, peak = [0], [0]

    def counted(name, get):
        def take():
            t = get()
            sizes[name] = t.numel()
            held[0] += t.numel()
            peak[0] = max(peak[0], held[0])
            return t

        return take

    class Into(dict):
        def __setitem__(self, name, t):
            held[0] -= t.numel()
            super().__setitem__(name, t)

    tensors = Tensors({k: counted(k, g) for k, g in files._get.items()})
    made = from_hf(cfg, tensors, Into())
    assert held[0] == 0 and len(sizes) == len(files)  # every tensor taken, and every element handed on
    blocks: dict[str, int] = {}
    for name, n in sizes.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        key = m.group(1) if m else name
        blocks[key] = blocks.get(key, 0) + n
    assert peak[0] <= max(blocks.values()) < sum(sizes.values()) / 2, (peak[0], max(blocks.values()), sum(sizes.values()))
    fresh = HybridMoE(cfg).double()
    fresh.load_state_dict(made)
    for name, t in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
