"""gpt-oss, Qwen3-Next and Kimi Linear, read from their Hugging Face configs with their weights
from a transformers checkpoint, trained a step on gloo: 8 ranks in nodes of 2, every mode's plan
(each distinct layout once; wide parents replicate the 2 key/value heads, or move MLA's heads of
two sizes; halo children pass gpt-oss's window's rows and the linear layers' states, every rank
slices the attention sinks of the query heads it holds), replicated and under FSDP2 with expert
parallelism (Kimi Linear's dense first block holds no experts), against the single-process model,
which tests/test_hf.py holds to transformers'. Every rank loads the checkpoint as --init-from
does (model.hf.load_hf) and the sharded model writes it back as --save-hf does (model.hf.save_hf),
bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from config import Cluster, HardwareConfig, read_hf_config
from kernels.exchange import ExchangeGroups
from model import HybridMoE, LocalPlacement, next_token_labels
from model.distributed import run_step
from model.hf import load_hf, save_hf
from model.sharding import full_tensor, shard_model
from solver import CostModel, make_plan, samples_from_lengths
from solver.modes import MODES
from tests.dist_utils import run_distributed
from tests.test_model_distributed import distinct_layouts, hand_plans

pytest.importorskip("transformers")

WORLD, NODE = 8, 2
LENGTHS = [61, 23, 17, 9, 7, 5, 3, 2, 1, 11]
# 8 query heads, so a parent spans all 8 ranks; 2 key/value heads, replicated in groups wider;
# Qwen3-Next's linear layers with 4 key and 8 value heads
ATTENTION = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8)
SHAPES = {
    "gpt_oss": dict(ATTENTION, sliding_window=6),
    "qwen3_next": dict(ATTENTION, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=4, linear_value_head_dim=4),
    # MLA's 8 heads, q/k of 8 and v of 6 (element j of every head a part of the exchange); KDA's 8 heads
    # (4 layers: the dense first block, a full layer among three KDA layers)
    "kimi_linear": dict(
        num_attention_heads=8,
        num_key_value_heads=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=6,
        kv_lora_rank=8,
        linear_num_heads=8,
        linear_head_dim=4,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    ),
}


def save_checkpoint(folder, family: str = "gpt_oss") -> str:
    """transformers' tiny model of `family` with every weight drawn (biases, sinks, norms), saved in `folder`."""
    from hf_utils import drawn_hf_model

    drawn_hf_model(family, 0, **SHAPES[family]).save_pretrained(folder)
    return str(folder)


def load(folder: str, ep: int = 1, rank: int = 0, sharded: bool = False) -> HybridMoE:
    """The project's model of the checkpoint in `folder`, float64, loaded as --init-from loads it
    (model.hf.load_hf: every rank reads the file, keeps its expert-parallel slot's experts and puts
    each tensor into its FSDP2 shards where `sharded`)."""
    model = HybridMoE(read_hf_config(folder)).double()
    model = model.expert_parallel(ep, rank) if ep > 1 else model
    model = shard_model(model, torch.device("cpu")) if sharded else model
    load_hf(model, folder)
    return model


def sample_tokens(vocab: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(7)
    return {i: rng.integers(0, vocab, n) for i, n in enumerate(LENGTHS)}


def reference(folder: str):
    model = load(folder)
    toks = sample_tokens(model.cfg.vocab)
    tokens = torch.as_tensor(np.concatenate([toks[i] for i in range(len(LENGTHS))]))
    labels = torch.as_tensor(np.concatenate(next_token_labels([toks[i] for i in range(len(LENGTHS))])))
    loss = model.loss(tokens, labels, LocalPlacement(LENGTHS, model.cfg, "torch"), sum(n - 1 for n in LENGTHS))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def plans(cfg) -> dict:
    """Every mode's plan of the step, by mode."""
    cost = CostModel(cfg, HardwareConfig())
    return {m: make_plan(samples_from_lengths(LENGTHS), Cluster(WORLD, NODE, 32), cost, m) for m in MODES}


def _body(rank, world, folder, ref):
    groups = ExchangeGroups(world)
    ref_loss, ref_grads = ref
    cfg = read_hf_config(folder)
    toks = sample_tokens(cfg.vocab)
    by_mode = plans(cfg)
    layouts = distinct_layouts(by_mode.values())
    assert any(p.group.size > NODE for plan in layouts for p in plan.parents), "a parent must span nodes"
    assert any(c.halo for plan in layouts for p in plan.parents for c in p.children), "a halo child must pass rows (and states)"
    once = load(folder).state_dict()  # the checkpoint as --init-from loads it, read once; each plan's model a copy
    for plan in layouts + list(hand_plans()):  # and one parent over all 8 ranks, repacked or not
        model = HybridMoE(cfg).double()
        model.load_state_dict(once)
        loss = run_step(model, plan, toks, groups, "torch", "torch")
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12, msg=plan.label)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-9, atol=1e-11, msg=f"{plan.label} {n}")
    ep = 2  # FSDP2 with the experts (their biases too) split over expert-parallel pairs
    per = cfg.n_experts // ep
    mine = slice((rank % ep) * per, (rank % ep + 1) * per)
    for plan in [by_mode["choose"]]:  # the per-parent choice: repacked and halo children
        model = load(folder, ep, rank, sharded=True)
        loss = run_step(model, plan, toks, groups, "torch", "torch")
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12, msg=f"fsdp ep2 {plan.label}")
        for n, p in model.named_parameters():
            want = ref_grads[n][mine] if ".experts." in n else ref_grads[n]
            torch.testing.assert_close(full_tensor(p.grad), want, rtol=1e-9, atol=1e-11, msg=f"fsdp ep2 {plan.label} {n}")
        # --save-hf's writer from the shards and the slots (a step takes no optimizer step): the loaded checkpoint, bit for bit
        save_hf(model, f"{folder}/saved")
        if rank == 0:
            saved, original = (load_file(f"{f}/model.safetensors") for f in (f"{folder}/saved", folder))
            assert saved.keys() == original.keys()
            for name, t in original.items():
                assert torch.equal(saved[name], t.double()), name


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(SHAPES))
def test_hf_model_from_a_transformers_checkpoint_trains_in_every_mode_as_one_process(tmp_path, family):
    folder = save_checkpoint(tmp_path, family)
    run_distributed(_body, WORLD, folder, reference(folder))


@pytest.mark.slow
def test_hf_train_driver_starts_from_a_transformers_checkpoint_and_writes_one_transformers_loads(tmp_path):
    """experiments.train --model hf:DIR --init-from hf:DIR on 4 ranks in nodes of 2 (FSDP2, EP2),
    every mode of one step (--mode all takes no optimizer step): each mode's loss is the one-rank
    run's; --save-hf writes the weights it loaded back bit for bit under transformers' names, and
    transformers loads that checkpoint and computes what it computes from the original."""
    from transformers import AutoModelForCausalLM

    from experiments.common.results import read_run
    from tests.dist_utils import forked_driver

    ckpt = save_checkpoint(tmp_path / "in")
    trace = tmp_path / "step.csv"
    trace.write_text("step,length\n" + "".join(f"0,{n}\n" for n in (100, 23, 17, 9, 7, 5, 3, 2, 1)))  # 100 > a node's 2 x 48
    common = ("--model", f"hf:{ckpt}", "--init-from", f"hf:{ckpt}", "--trace", str(trace), "--mode", "all", "--steps", "1")
    common += ("--dtype", "fp64")
    wide = ("--gpus-per-node", "2", "--tokens-per-rank", "48", "--ep", "2", "--save-hf", str(tmp_path / "out"))
    p = forked_driver(4, *common, *wide, "--out", str(tmp_path / "four"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"initialized from the Hugging Face checkpoint hf:{ckpt}" in p.stdout
    p = forked_driver(1, *common, "--gpus-per-node", "1", "--tokens-per-rank", "256", "--out", str(tmp_path / "one"))
    assert p.returncode == 0, p.stderr[-3000:]
    (one,) = read_run(str(tmp_path / "one"))[0][:1]
    rows = read_run(str(tmp_path / "four"))[0]
    assert len(rows) == len({r["mode"] for r in rows}) > 5 and any(r["wide_parents"] for r in rows)
    for r in rows:
        np.testing.assert_allclose(r["loss"], one["loss"], rtol=1e-12, err_msg=r["mode"])
    saved, original = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(f"{ckpt}/model.safetensors")
    assert saved.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(saved[name], t.double()), name
    ids = torch.arange(11)[None] % 97
    load = lambda f: AutoModelForCausalLM.from_pretrained(f, experts_implementation="eager").double()  # noqa: E731
    theirs = [load(f)(input_ids=ids).logits for f in (ckpt, str(tmp_path / "out"))]
    torch.testing.assert_close(theirs[0], theirs[1], rtol=0, atol=0)
