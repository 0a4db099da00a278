"""Checkpoints (experiments.checkpoint) on 2 gloo ranks with an FSDP2-sharded tiny model: atomic,
exact, and safe: a crafted file cannot run code, damage is found and named, a mismatched run is
one line. Each case was once silent or dangerous (pickled checkpoints, no checksums)."""

import json
import os
import pickle
import shutil

import pytest
import torch

from config import ModelConfig
from experiments.common.files import sha256_of
from experiments.train import checkpoint
from experiments.train.checkpoint import CheckpointError
from model import HybridMoE
from model.sharding import full_tensor, shard_model
from tests.dist_utils import run_distributed

CFG = ModelConfig.from_name("tiny")


def _model_and_opt(seed=0):
    torch.manual_seed(seed)
    model = shard_model(HybridMoE(CFG).double(), torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train_a_step(model, opt, seed):
    torch.manual_seed(seed)
    for p in model.parameters():  # a made-up gradient: the optimizer then has state to save
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad()


def _weights(model):
    return {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}


class Boom:
    """An object whose unpickling runs a shell command (the classic crafted checkpoint)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rewrite_manifest(folder):
    """What a crafter would do: make the manifest match the crafted files."""
    files = sorted(f for f in os.listdir(folder) if f != checkpoint.MANIFEST)
    entry = {f: {"bytes": os.path.getsize(os.path.join(folder, f)), "sha256": sha256_of(os.path.join(folder, f))} for f in files}
    with open(os.path.join(folder, checkpoint.MANIFEST), "w") as fh:
        json.dump(entry, fh)


def _body(rank, world, root):
    import torch.distributed as dist

    ck = os.path.join(root, "ck")
    meta = {"model": CFG.to_dict(), "fingerprint": {"seed": 0, "betas": (0.9, 0.95)}, "scheduler": {}, "rows": [{"loss": 1.5}]}
    expect = {"world_size": world, "model": CFG.to_dict(), "fingerprint": {"seed": 0, "betas": (0.9, 0.95)}}
    model, opt = _model_and_opt()
    _train_a_step(model, opt, 1)
    checkpoint.save(ck, 2, model, opt, meta)
    at2 = _weights(model)
    _train_a_step(model, opt, 2)
    checkpoint.save(ck, 4, model, opt, meta)
    at4 = _weights(model)
    _train_a_step(model, opt, 3)
    after = _weights(model)

    # exact: a fresh model loads step 4 and takes the same next step, bit for bit
    fresh, fopt = _model_and_opt(seed=9)
    got = checkpoint.load(ck, fresh, fopt, expect)
    assert got["step"] == 4 and got["rows"] == [{"loss": 1.5}]
    assert all(torch.equal(v, at4[n]) for n, v in _weights(fresh).items())
    _train_a_step(fresh, fopt, 3)
    assert all(torch.equal(v, after[n]) for n, v in _weights(fresh).items())
    assert sorted(os.listdir(ck)) == ["latest", "step_0000002", "step_0000004"]

    # a crash while writing step 6 leaves a .tmp folder: the last complete one still loads
    dist.barrier()  # every rank has listed the folder before rank 0 adds to it
    if rank == 0:
        os.makedirs(os.path.join(ck, "step_0000006.tmp"))
        with open(os.path.join(ck, "step_0000006.tmp", "__0_0.distcp"), "wb") as fh:
            fh.write(b"\0partial")
    dist.barrier()
    assert checkpoint.load(ck, *_model_and_opt(), expect)["step"] == 4

    # damage: 5,000 zero bytes inside step 4's shard file are found and named; --resume falls back
    # to step 2 with a warning; --resume-step 4 is an error naming the file
    dist.barrier()
    shard = os.path.join(ck, "step_0000004", "__0_0.distcp")
    if rank == 0:
        with open(shard, "r+b") as fh:
            fh.seek(100)
            fh.write(b"\0" * 5000)
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"__0_0.distcp' fails its sha256 check"):
        checkpoint.load(ck, *_model_and_opt(), expect, step=4)
    m2, o2 = _model_and_opt()
    ctx = pytest.warns(UserWarning, match="step_0000004 is unusable") if rank == 0 else _nothing()
    with ctx:
        assert checkpoint.load(ck, m2, o2, expect)["step"] == 2
    assert all(torch.equal(v, at2[n]) for n, v in _weights(m2).items())
    dist.barrier()
    if rank == 0:  # truncated: named by size
        with open(shard, "r+b") as fh:
            fh.truncate(64)
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"has 64 bytes, the manifest says"):
        checkpoint.load(ck, *_model_and_opt(), expect, step=4)

    # a crafted metadata file whose unpickling would run a command, with a manifest to match:
    # refused, and the command never runs
    marker = os.path.join(root, "pwned")  # what the payload would create, were it run on any rank
    dist.barrier()
    if rank == 0:
        bad = os.path.join(ck, "step_0000002")
        with open(os.path.join(bad, ".metadata"), "wb") as fh:
            pickle.dump(Boom(marker), fh)
        _rewrite_manifest(bad)
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"refers to (posix|os)\.system, which DCP metadata never holds"):
        checkpoint.load(ck, *_model_and_opt(), expect, step=2)
    dist.barrier()
    assert not os.path.exists(marker)

    # `latest` may only name a checkpoint folder inside ckpt_dir
    dist.barrier()
    if rank == 0:
        with open(os.path.join(ck, "latest"), "w") as fh:
            fh.write("../../etc")
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"holds '../../etc'; it must name a checkpoint folder"):
        checkpoint.load(ck, *_model_and_opt(), expect)

    # another model or another world size: one line naming the mismatch
    ck2 = os.path.join(root, "ck2")
    model, opt = _model_and_opt()
    checkpoint.save(ck2, 1, model, opt, meta)
    other = {**expect, "model": ModelConfig.from_name("tiny-gqa").to_dict()}
    with pytest.raises(CheckpointError, match=r"holds another model: .*n_kv_heads=8 there, 2 here"):
        checkpoint.load(ck2, *_model_and_opt(), other)
    with pytest.raises(CheckpointError, match=rf"written by {world} ranks and this run has 8"):
        checkpoint.load(ck2, *_model_and_opt(), {**expect, "world_size": 8})
    with pytest.raises(CheckpointError, match=r"is of another run: seed=0 there, 1 here"):
        checkpoint.load(ck2, *_model_and_opt(), {**expect, "fingerprint": {"seed": 1, "betas": (0.9, 0.95)}})


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.slow
def test_checkpoints_are_exact_atomic_checked_and_never_run_code(tmp_path):
    run_distributed(_body, 2, str(tmp_path))
    shutil.rmtree(tmp_path / "ck", ignore_errors=True)


def test_rng_states_round_trip_through_json():
    import random

    import numpy as np

    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    state = json.loads(json.dumps(checkpoint.rng_state()))
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    checkpoint.set_rng_state(state)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]


# ----- expert parallelism: every expert saved once, read back at any degree ---------------------------
def _ep_model(ep, rank, shard, seed=0, cfg=CFG):
    from model.sharding import replicate_experts

    torch.manual_seed(seed)
    model = HybridMoE(cfg).double()
    if ep > 1:
        model.expert_parallel(ep, rank)
    model = shard_model(model, torch.device("cpu")) if shard else replicate_experts(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _elementwise_step(model, opt):
    """An optimizer step whose gradient is an elementwise function of the weights: the same update of
    every element whatever the layout, so every layout's state is a slice of one whole model's."""
    for p in model.parameters():
        p.grad = torch.sin(3 * p.detach() + 1)
    opt.step()
    opt.zero_grad()


# written at (degree, FSDP2 or replicated): read at
EP_READS = {
    (2, True): ((1, True), (2, True), (4, True), (2, False)),
    (4, True): ((2, False),),
    (2, False): ((4, True), (1, True)),
}
# two experts: at EP 2 a slot's one expert is held by two replicas, and without EP both by four
# ranks, so FSDP2 shards them on their hidden dim (solver.cost.shard_dim), not on the experts
HIDDEN_DIM_CFG = CFG.replace(n_experts=2)
HIDDEN_DIM_READS = {(2, True): ((1, True), (2, False), (1, False))}


def _ep_body(rank, world, root, cfg=CFG, reads=EP_READS):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.tensor import Shard

    from model.sharding import parameter_count

    whole, wopt = _ep_model(1, rank, shard=False, cfg=cfg)  # the yardstick: one process's whole model (no collective)
    _elementwise_step(whole, wopt)
    want = {n: (p.detach(), wopt.state[p]["exp_avg"], wopt.state[p]["exp_avg_sq"]) for n, p in whole.named_parameters()}
    meta = {"model": cfg.to_dict(), "fingerprint": {}, "scheduler": {}, "rows": []}
    expect = {"world_size": world, "model": cfg.to_dict(), "fingerprint": {}}
    e = cfg.n_experts
    for (ep, shard), read_at in reads.items():
        ck = os.path.join(root, f"ep{ep}{'fsdp' if shard else 'replicated'}")
        model, opt = _ep_model(ep, rank, shard, cfg=cfg)
        if cfg is HIDDEN_DIM_CFG:  # the case this config is for: the experts sharded on their hidden dim
            assert model.blocks[0].moe.experts.w1.placements == (Shard(1),)
        _elementwise_step(model, opt)
        checkpoint.save(ck, 1, model, opt, meta)
        # the metadata holds the whole layer's experts, and the model's parameter count
        md = FileSystemReader(os.path.join(ck, "step_0000001")).read_metadata().state_dict_metadata
        assert list(md["model.blocks.0.moe.experts.w1"].size) == [e, cfg.hidden, cfg.expert_ffn]
        assert list(md["optim.state.blocks.0.moe.experts.w2.exp_avg"].size) == [e, cfg.expert_ffn, cfg.hidden]
        total = sum(int(torch.Size(v.size).numel()) for k, v in md.items() if k.startswith("model."))
        assert total == sum(p.numel() for p in whole.parameters()) == parameter_count(cfg)
        for ep_read, shard_read in read_at:
            fresh, fopt = _ep_model(ep_read, rank, shard_read, seed=5, cfg=cfg)
            _elementwise_step(fresh, fopt)  # state of its own, to be replaced
            checkpoint.load(ck, fresh, fopt, expect)
            per = e // ep_read
            mine = slice((rank % ep_read) * per, (rank % ep_read + 1) * per)
            for n, p in fresh.named_parameters():
                got = (p.detach(), fopt.state[p]["exp_avg"], fopt.state[p]["exp_avg_sq"])
                for g, w in zip(got, want[n]):
                    assert torch.equal(full_tensor(g), w[mine] if ".experts." in n else w), (ep, shard, ep_read, shard_read, n)
    if cfg is HIDDEN_DIM_CFG:
        return
    # the check at save time: the old layout (each slot's experts under the whole layer's name)
    # writes half the experts, and is refused before the checkpoint is renamed into place
    model, opt = _ep_model(2, rank, shard=True)
    real = checkpoint.experts_as_global
    checkpoint.experts_as_global = lambda state, model: state
    try:
        with pytest.raises(checkpoint.IncompleteCheckpoint, match=r"holds [\d,]+ model parameters, the model has [\d,]+"):
            checkpoint.save(os.path.join(root, "old"), 1, model, opt, meta)
    finally:
        checkpoint.experts_as_global = real
    dist_barrier()
    assert not os.path.exists(os.path.join(root, "old", "step_0000001")) and not os.path.exists(os.path.join(root, "old", "latest"))


def dist_barrier():
    import torch.distributed as dist

    dist.barrier()


@pytest.mark.slow
def test_expert_parallel_checkpoints_hold_every_expert_once_and_load_at_any_degree(tmp_path):
    run_distributed(_ep_body, 4, str(tmp_path))


@pytest.mark.slow
def test_a_checkpoint_of_experts_sharded_on_their_hidden_dim_holds_each_once_and_loads_at_another_degree(tmp_path):
    """Fewer experts a slot than replicas: FSDP2 shards them on their hidden dim (dim 0 would be
    padded), and the checkpoint still holds the whole layer's experts once, read back at EP 1 and
    replicated as the single-process model's slice."""
    run_distributed(_ep_body, 4, str(tmp_path), HIDDEN_DIM_CFG, HIDDEN_DIM_READS)
