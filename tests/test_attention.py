"""Attention backends against the torch reference; the sparse-kind registry end to end."""

import math

import numpy as np
import pytest
import torch

from config import Cluster, HardwareConfig, ModelConfig, SettingError
from model import HybridMoE, LocalPlacement, register_sparse_attention, varlen_attention
from model.attention import flash_available, torch_varlen_attention
from solver import CostModel, make_plan, samples_from_lengths
from solver.cost import attention_flops
from solver.simulator import simulate

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def dense_reference(q, k, v, cu, allowed_fn, sinks=None):
    """Attention written out per query, in fp64: the yardstick for every backend (values of their
    own head size; sinks [H]: a logit per query head joining each softmax, then dropped)."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    h, hkv = q.shape[1], k.shape[1]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for i in range(b - a):
            keys = [j for j in range(b - a) if j <= i and allowed_fn(i, j)]
            for hh in range(h):
                kh = hh // (h // hkv)
                s = torch.stack([(q[a + i, hh].double() * k[a + j, kh].double()).sum() / math.sqrt(q.shape[2]) for j in keys])
                w = torch.softmax(s, 0) if sinks is None else torch.softmax(torch.cat([s, sinks[hh].double()[None]]), 0)[:-1]
                out[a + i, hh] = sum(w[t] * v[a + keys[t], kh].double() for t in range(len(keys)))
    return out


@pytest.mark.parametrize(
    "kind, params, allowed",
    [
        ("full", None, lambda i, j: True),
        ("sliding_window", {"window": 3}, lambda i, j: i - j < 3),
        ("chunked", {"chunk": 4}, lambda i, j: i // 4 == j // 4),
    ],
    ids=["full", "swa-W3", "chunked-C4"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_torch_backend_matches_dense_reference(kind, params, allowed, dtype):
    torch.manual_seed(0)
    cu = torch.tensor([0, 7, 8, 19], dtype=torch.int32)
    q = torch.randn(19, 4, 8, dtype=dtype)
    k, v = torch.randn(19, 2, 8, dtype=dtype), torch.randn(19, 2, 8, dtype=dtype)
    got = varlen_attention(q, k, v, cu, 11, kind, params, "torch")
    torch.testing.assert_close(got.double(), dense_reference(q, k, v, cu, allowed), **TOL[dtype])


@pytest.mark.parametrize(
    "kind, params, allowed",
    [("full", None, lambda i, j: True), ("sliding_window", {"window": 3}, lambda i, j: i - j < 3)],
    ids=["full", "swa-W3"],
)
def test_torch_backend_runs_sinks_and_value_heads_of_their_own_size_as_the_dense_reference(kind, params, allowed):
    torch.manual_seed(1)
    cu = torch.tensor([0, 7, 8, 19], dtype=torch.int32)
    q, k, v = (
        torch.randn(19, 4, 8, dtype=torch.float64),
        torch.randn(19, 2, 8, dtype=torch.float64),
        torch.randn(19, 2, 12, dtype=torch.float64),
    )
    sinks = torch.randn(4, dtype=torch.float64)
    for backend in ("torch", "auto", "kernel"):  # auto and kernel take the torch path for sinks and for v's own size
        got = varlen_attention(q, k, v, cu, 11, kind, params, backend, sinks=sinks)
        torch.testing.assert_close(got, dense_reference(q, k, v, cu, allowed, sinks), **TOL[torch.float64])
        no_sinks = varlen_attention(q, k, v, cu, 11, kind, params, backend)
        torch.testing.assert_close(no_sinks, dense_reference(q, k, v, cu, allowed), **TOL[torch.float64])


@pytest.mark.parametrize("window", [None, 4], ids=["full", "swa-W4"])
def test_hf_sinks_match_transformers_gpt_oss_attention_and_its_gradients(window):
    """The torch path with sinks against gpt-oss's attention in transformers (its eager form, on
    each sample alone with its causal and window mask), float64: outputs and the gradients of a
    loss by q, k, v and the sinks."""
    from types import SimpleNamespace

    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    torch.manual_seed(2)
    cu = [0, 6, 13]
    h, hkv, d = 4, 2, 8
    leaves = [torch.randn(13, n, d, dtype=torch.float64, requires_grad=True) for n in (h, hkv, hkv)] + [
        torch.randn(h, dtype=torch.float64, requires_grad=True)
    ]
    q, k, v, sinks = leaves
    w = torch.randn(13, h, d, dtype=torch.float64)
    params = None if window is None else {"window": window}
    ours = varlen_attention(q, k, v, torch.tensor(cu), 7, "full" if window is None else "sliding_window", params, "torch", sinks=sinks)
    mine = torch.autograd.grad((ours * w).sum(), leaves)
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=h // hkv, training=False)
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        n = b - a
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (j <= i) & (True if window is None else (i - j < window))
        mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~allowed, float("-inf"))[None, None]
        per = [x[a:b].transpose(0, 1)[None] for x in (q, k, v)]  # [1, heads, n, d]
        outs.append(gpt_oss.eager_attention_forward(module, *per, mask, d**-0.5)[0][0])  # [n, h, d]
    theirs = torch.cat(outs)
    torch.testing.assert_close(ours, theirs, **TOL[torch.float64])
    for got, want in zip(mine, torch.autograd.grad((theirs * w).sum(), leaves)):
        torch.testing.assert_close(got, want, **TOL[torch.float64])


def test_cuda_kernels_refuse_sinks_and_value_heads_of_their_own_size_naming_the_torch_path_and_an_empty_rank_still_grads_them():
    q = torch.randn(5, 2, 8)
    sinks = torch.zeros(2, requires_grad=True)
    for backend in ("flash", "varlen"):
        with pytest.raises(ValueError, match=f"attention backend '{backend}' takes no attention sinks.*torch or auto"):
            varlen_attention(q, q, q, torch.tensor([0, 5]), 5, "full", None, backend, fn=lambda *a, **k: None, sinks=sinks)
        with pytest.raises(
            ValueError, match=f"attention backend '{backend}' takes value heads of the query's size only \\(here 12 and 8\\).*torch or auto"
        ):
            varlen_attention(q, q, torch.randn(5, 2, 12), torch.tensor([0, 5]), 5, "full", None, backend, fn=lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"sinks of shape \(3,\): one logit per query head, \(2,\)"):
        varlen_attention(q, q, q, torch.tensor([0, 5]), 5, "full", None, "torch", sinks=torch.zeros(3))
    empty = torch.zeros(0, 2, 8, requires_grad=True)
    out = varlen_attention(empty, empty, torch.zeros(0, 2, 12), torch.tensor([0]), 0, sinks=sinks)
    assert out.shape == (0, 2, 12)
    out.sum().backward()
    assert sinks.grad is not None and not sinks.grad.any()


def _windowed_reference(q, k, v, cu, left):
    """Causal attention on the last left + 1 keys (left = -1: all keys): what a CUDA kernel's
    (left, 0) window computes."""
    return torch_varlen_attention(q, k, v, cu, mask=None if left < 0 else (lambda qp, kp, p: (qp - kp) <= left))


def test_flash_wrapper_passes_causal_window_and_cu_seqlens():
    seen = []

    def fake_flash(q, k, v, cu_q, cu_k, max_q, max_k, causal, window_size):
        seen.append((cu_q.dtype, cu_q.tolist(), max_q, causal, window_size))
        assert causal and window_size[1] in (-1, 0)
        return _windowed_reference(q, k, v, cu_q, window_size[0])

    q = torch.randn(12, 4, 8)
    cu = torch.tensor([0, 5, 12])
    a = varlen_attention(q, q, q, cu, 7, "sliding_window", {"window": 4}, "flash", fn=fake_flash)
    assert seen[-1] == (torch.int32, [0, 5, 12], 7, True, (3, 0))  # "the last W tokens" = (W - 1, 0)
    torch.testing.assert_close(a, varlen_attention(q, q, q, cu, 7, "sliding_window", {"window": 4}, "torch"))
    varlen_attention(q, q, q, cu, 7, "full", backend="flash", fn=fake_flash)
    assert seen[-1][3:] == (True, (-1, -1))
    varlen_attention(q, q, q, cu, 7, "chunked", {"chunk": 4}, "flash", fn=fake_flash)
    assert seen[-1][1] == [0, 4, 5, 9, 12]  # chunked = causal attention on refined cu_seqlens


def test_torch_varlen_wrapper_passes_window_gqa_and_cu_seqlens():
    """torch.nn.attention.varlen.varlen_attn has no causal flag: causal is window (-1, 0), the last
    W tokens (W - 1, 0); GQA needs enable_gqa. Checked with a stand-in that computes what those
    arguments mean, against the torch path, for every kind (no CUDA needed)."""
    seen = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
        seen.append((cu_q.dtype, cu_q.tolist(), cu_k.tolist(), max_q, max_k, window_size, enable_gqa))
        assert window_size[1] == 0, "right window 0 makes the kernel causal"
        assert enable_gqa == (k.shape[1] != q.shape[1]), "GQA must be asked for"
        return _windowed_reference(q, k, v, cu_q, window_size[0])

    torch.manual_seed(0)
    q, kv = torch.randn(12, 4, 8, dtype=torch.float64), torch.randn(12, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0, 5, 12])
    for kind, params, window in (("full", None, (-1, 0)), ("sliding_window", {"window": 4}, (3, 0)), ("chunked", {"chunk": 4}, (-1, 0))):
        got = varlen_attention(q, kv, kv, cu, 7, kind, params, "varlen", fn=fake_varlen)
        torch.testing.assert_close(got, varlen_attention(q, kv, kv, cu, 7, kind, params, "torch"))
        assert seen[-1][5:] == (window, True)
    assert seen[-1][:5] == (torch.int32, [0, 4, 5, 9, 12], [0, 4, 5, 9, 12], 4, 4)
    with pytest.raises(ValueError, match="backend must be one of"):
        varlen_attention(q, kv, kv, cu, 7, "full", None, "torch", fn=fake_varlen)


def test_auto_takes_a_cuda_kernel_only_for_the_dtypes_it_runs(monkeypatch):
    """flash-attn's and torch's varlen kernels run fp16 and bf16 only (torch's raised "FlashAttention
    only support fp16 and bf16 data type" on an H200 for an fp32 training step): on CUDA, auto takes
    them for half precision and the torch path for fp32 and fp64; naming one for fp32 is an error."""
    import model.attention as attention

    monkeypatch.setattr(attention, "flash_available", lambda: False)
    monkeypatch.setattr(attention, "varlen_available", lambda: True)
    cuda = torch.device("cuda")
    assert [attention.resolve_backend("auto", cuda, dt) for dt in (torch.bfloat16, torch.float16)] == ["varlen", "varlen"]
    assert [attention.resolve_backend("auto", cuda, dt) for dt in (torch.float32, torch.float64)] == ["kernel", "kernel"]
    assert attention.resolve_backend("auto", torch.device("cpu"), torch.bfloat16) == "kernel"
    with pytest.raises(ValueError, match=r"attention backend 'varlen' runs fp16 and bf16, not torch.float32: use --dtype bf16"):
        attention.resolve_backend("varlen", cuda, torch.float32)
    assert attention.resolve_backend("torch", cuda, torch.float32) == "torch"


def test_torch_varlen_wrapper_on_older_torch_signatures_repeats_kv_heads_and_refuses_windows_it_cannot_ask_for():
    """torch 2.11's varlen_attn has window_size but no enable_gqa, 2.10's only is_causal (what a GPU
    image with an older torch holds): GQA then repeats each key/value head for the query heads that
    read it, so the result equals the torch path's GQA; a window on 2.10 is an error naming torch."""
    seen = []

    def varlen_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        seen.append((k.shape[1], window_size))
        assert window_size[1] == 0 and k.shape[1] == q.shape[1], "no enable_gqa: heads must match"
        return _windowed_reference(q, k, v, cu_q, window_size[0])

    def varlen_2_10(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, is_causal=False):
        seen.append((k.shape[1], is_causal))
        assert is_causal and k.shape[1] == q.shape[1]
        return _windowed_reference(q, k, v, cu_q, -1)

    torch.manual_seed(0)
    q, k, v = (torch.randn(12, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 12])
    for kind, params in (("full", None), ("sliding_window", {"window": 4}), ("chunked", {"chunk": 4})):
        got = varlen_attention(q, k, v, cu, 7, kind, params, "varlen", fn=varlen_2_11)
        torch.testing.assert_close(got, varlen_attention(q, k, v, cu, 7, kind, params, "torch"))
    assert seen[-2:] == [(4, (3, 0)), (4, (-1, 0))]
    for kind, params in (("full", None), ("chunked", {"chunk": 4})):
        got = varlen_attention(q, k, v, cu, 7, kind, params, "varlen", fn=varlen_2_10)
        torch.testing.assert_close(got, varlen_attention(q, k, v, cu, 7, kind, params, "torch"))
    assert seen[-1] == (4, True)
    with pytest.raises(RuntimeError, match="no window_size, so it cannot run a window of 4 tokens"):
        varlen_attention(q, k, v, cu, 7, "sliding_window", {"window": 4}, "varlen", fn=varlen_2_10)


@pytest.mark.parametrize(
    "kind, params, allowed", [("full", None, lambda i, j: True), ("sliding_window", {"window": 3}, lambda i, j: i - j < 3)]
)
def test_torch_path_in_query_blocks_matches_dense_reference(kind, params, allowed):
    """A long sample runs in query blocks (budget of 40 score elements: 2-3 queries of 4 heads a
    block here) and gives what the dense yardstick gives."""
    torch.manual_seed(1)
    cu = torch.tensor([0, 13, 14, 31], dtype=torch.int32)
    q, k, v = (
        torch.randn(31, 4, 8, dtype=torch.float64),
        torch.randn(31, 2, 8, dtype=torch.float64),
        torch.randn(31, 2, 8, dtype=torch.float64),
    )
    mask = None if kind == "full" else (lambda qp, kp, p: (qp - kp) < p["window"])
    got = torch_varlen_attention(q, k, v, cu, mask=mask, params=params, budget=40)
    torch.testing.assert_close(got, dense_reference(q, k, v, cu, allowed), **TOL[torch.float64])


def _cuda_backends():
    from model.attention import varlen_available

    out = []
    for name, ok, why in (
        ("flash", flash_available(), "flash-attn needs CUDA and the optional flash-attn package"),
        ("varlen", varlen_available(), "torch's varlen attention needs CUDA"),
    ):
        out.append(pytest.param(name, marks=pytest.mark.skipif(not ok, reason=why)))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("backend", _cuda_backends())
@pytest.mark.parametrize("kind, params", [("full", None), ("sliding_window", {"window": 64}), ("chunked", {"chunk": 64})])
@pytest.mark.parametrize("hkv", [8, 2], ids=["mha", "gqa"])
def test_cuda_backend_error_at_most_twice_torch_error(backend, kind, params, hkv):
    torch.manual_seed(0)
    cu = torch.tensor([0, 97, 160, 383], dtype=torch.int32, device="cuda")
    q = torch.randn(383, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(383, hkv, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ref = varlen_attention(q.double(), k.double(), v.double(), cu, 223, kind, params, "torch")
    got = varlen_attention(q, k, v, cu, 223, kind, params, backend)
    tc = varlen_attention(q, k, v, cu, 223, kind, params, "torch")
    assert (got.double() - ref).abs().max() <= 2 * (tc.double() - ref).abs().max() + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("backend", _cuda_backends())
@pytest.mark.parametrize("kind, params", [("sliding_window", {"window": 64}), ("chunked", {"chunk": 64})])
def test_cuda_backend_with_halo_keys_error_at_most_twice_torch_error(backend, kind, params):
    """A halo child's queries with keys reaching back before them (causal aligned bottom-right)."""
    from model.attention import KeySegments

    torch.manual_seed(0)
    # keys from the kind's reach back: a window's last 63 positions, a chunk's start (64)
    q_pos, nq = np.array([0, 70, 128]), [70, 58, 40]
    k_pos = np.array([0, 7, 128]) if kind == "sliding_window" else np.array([0, 64, 128])
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(nq)]), dtype=torch.int32, device="cuda")
    nk = [n + (p - k) for n, p, k in zip(nq, q_pos, k_pos)]
    keys = KeySegments(torch.tensor(np.concatenate([[0], np.cumsum(nk)]), dtype=torch.int32, device="cuda"), max(nk), q_pos, k_pos)
    q = torch.randn(sum(nq), 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(nk), 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ref = varlen_attention(q.double(), k.double(), v.double(), cu_q, max(nq), kind, params, "torch", keys=keys)
    got = varlen_attention(q, k, v, cu_q, max(nq), kind, params, backend, keys=keys)
    tc = varlen_attention(q, k, v, cu_q, max(nq), kind, params, "torch", keys=keys)
    assert (got.double() - ref).abs().max() <= 2 * (tc.double() - ref).abs().max() + 1e-6


def test_keys_reaching_back_match_the_whole_samples_attention():
    """A sample cut in chunks, each with the keys its queries reach back to (a halo child), gives
    the whole sample's attention, sliding window and chunked: the torch path with key segments."""
    from model.attention import KeySegments
    from solver.cost import sparse_cost

    torch.manual_seed(0)
    n, cuts = 50, [0, 11, 23, 38, 50]
    q = torch.randn(n, 4, 8, dtype=torch.float64)
    k, v = torch.randn(n, 2, 8, dtype=torch.float64), torch.randn(n, 2, 8, dtype=torch.float64)
    for kind, params in (("sliding_window", {"window": 7}), ("chunked", {"chunk": 9})):
        whole = varlen_attention(q, k, v, torch.tensor([0, n]), n, kind, params, "torch")
        first = sparse_cost(kind).first_key(np.array(cuts[:-1]), params)
        k_rows = np.concatenate([np.arange(f, b) for f, b in zip(first, cuts[1:])])
        cu_k = np.concatenate([[0], np.cumsum([b - f for f, b in zip(first, cuts[1:])])])
        keys = KeySegments(torch.tensor(cu_k, dtype=torch.int32), int(np.diff(cu_k).max()), np.array(cuts[:-1]), first)
        got = varlen_attention(q, k[k_rows], v[k_rows], torch.tensor(cuts, dtype=torch.int32), 15, kind, params, "torch", keys=keys)
        torch.testing.assert_close(got, whole, rtol=1e-12, atol=1e-12)


def test_registering_a_sparse_kind_reaches_model_solver_and_simulator():
    def strided_flops(scale):
        return lambda n, cfg: attention_flops(np.asarray(n, dtype=float) * cfg.sparse_params["local"] * scale, cfg)

    def strided(qp, kp, p):
        return ((qp - kp) < p["local"]) | (kp % p["stride"] == 0)

    local, stride = 3, 4
    params = {"local": 2, "stride": 8}  # the kind's parameters and their defaults
    register_sparse_attention("strided_test", mask=strided, flops=strided_flops(1.5), params=params, overwrite=True)
    cfg = ModelConfig.from_name("tiny", sparse_kind="strided_test", sparse_params={"local": local, "stride": stride})

    # the model: its sparse layers attend with the registered mask (the dense yardstick agrees, and
    # the same weights give another output under a plain causal pattern)
    torch.manual_seed(0)
    cu = torch.tensor([0, 11, 16], dtype=torch.int32)
    q, k, v = (
        torch.randn(16, 4, 8, dtype=torch.float64),
        torch.randn(16, 2, 8, dtype=torch.float64),
        torch.randn(16, 2, 8, dtype=torch.float64),
    )
    got = varlen_attention(q, k, v, cu, 11, "strided_test", cfg.sparse_params, "torch")
    torch.testing.assert_close(got, dense_reference(q, k, v, cu, lambda i, j: i - j < local or j % stride == 0), **TOL[torch.float64])
    register_sparse_attention("causal_test", mask=lambda qp, kp, p: qp >= kp, flops=strided_flops(1.5), params=params, overwrite=True)
    model = HybridMoE(cfg).double()
    tokens = torch.randint(0, cfg.vocab, (16,))
    h, _ = model(tokens, LocalPlacement([11, 5], cfg, "torch"))
    h_causal, _ = model(tokens, LocalPlacement([11, 5], cfg.replace(sparse_kind="causal_test"), "torch"))
    assert torch.isfinite(h).all() and not torch.allclose(h, h_causal)

    # the solver and the simulator: they price the registered FLOPs. Doubling them adds exactly
    # the extra sparse-attention compute (every attention pass, every sparse layer) to the step
    cluster = Cluster(8, 2, 128)
    lengths = [100, 60, 30, 17, 9, 5, 3]
    compute = {}
    for scale in (1.5, 3.0):
        register_sparse_attention("strided_test", mask=strided, flops=strided_flops(scale), params=params, overwrite=True)
        cost = CostModel(cfg, HardwareConfig())
        plan = make_plan(samples_from_lengths(lengths), cluster, cost, "repack+solver")
        compute[scale] = simulate(plan, cost).compute * cluster.world_size  # rank-seconds of compute
    extra = cost.attention_passes * cfg.n_sparse * float(strided_flops(1.5)(lengths, cfg).sum()) / cost.attn_rate
    assert compute[3.0] - compute[1.5] == pytest.approx(extra, rel=1e-9)
    with pytest.raises(SettingError, match="sparse kind 'strided_test' has no parameter 'width'"):
        CostModel(cfg.replace(sparse_params={"width": 3}), HardwareConfig())
    with pytest.raises(ValueError, match="already registered"):
        register_sparse_attention("strided_test", mask=lambda a, b, p: a >= b, flops=lambda n, c: n)
    with pytest.raises(SettingError, match="model.sparse_kind='unpriced' is not a registered sparse kind"):
        register_sparse_attention("unpriced", mask=lambda a, b, p: a >= b)  # no FLOPs: the solver could not price it


def test_tied_embeddings_share_the_table_and_train():
    cfg = ModelConfig.from_name("tiny", tie_embeddings=True)
    model = HybridMoE(cfg)
    assert model.lm_head is None
    tokens = torch.randint(0, cfg.vocab, (9,))
    labels = torch.cat([tokens[1:5], torch.tensor([-100]), tokens[6:], torch.tensor([-100])])
    loss = model.loss(tokens, labels, LocalPlacement([5, 4], cfg, "torch"), 7)
    loss.backward()
    assert torch.isfinite(loss) and model.embed.weight.grad.abs().sum() > 0
