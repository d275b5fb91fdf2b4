"""MoE: routing and the reference against float64 formulas, the Triton grouped GEMM against the
reference, and bitwise batch invariance (a token alone vs among others sharing its experts)."""

from __future__ import annotations

import pytest
import torch

from kernels import KernelInputError
from kernels._testing import assert_close
from kernels.moe import fused_moe, moe_route, moe_route_sigmoid, naive_fused_moe, naive_moe_route
from tests.kernels.conftest import generator, requires_triton

RATIO = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}
# (T, H, E, I, K): odd sizes, a single token, more slots than some experts get, K == E.
SHAPES = [(1, 64, 4, 32, 4), (5, 48, 5, 20, 2), (37, 40, 7, 24, 3), (19, 72, 9, 36, 1)]


def make_weights(h, e, i, dtype, seed=0):
    gen = generator(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
    return w13, w2


def float64_moe(x, w13, w2, weights, ids):
    """Token by token, slot by slot, in float64: the formula as written."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    i = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e] @ x[t]
            out[t] += weights[t, k] * (w2[e] @ (torch.nn.functional.silu(h[:i]) * h[i:]))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_softmax_topk(renormalize):
    logits = torch.randn(23, 9)
    weights, ids = moe_route(logits, 3, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == logits.dtype and weights.shape == (23, 3)
    probs = torch.softmax(logits.double(), -1)
    expected_ids = probs.argsort(dim=-1, descending=True)[:, :3]
    assert torch.equal(ids.long(), expected_ids)
    expected = probs.gather(1, expected_ids)
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-6, atol=1e-7)
    # The weights come back in the logits' dtype, computed in float32 (as transformers' router).
    w16, ids16 = naive_moe_route(logits.bfloat16(), 3, renormalize)
    assert w16.dtype == torch.bfloat16 and ids16.shape == (23, 3)


@pytest.mark.parametrize(
    "t, h, e, i, k", SHAPES, ids=[f"T{t}-H{h}-E{e}-I{i}-K{k}" for t, h, e, i, k in SHAPES]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_float64(t, h, e, i, k, dtype):
    w13, w2 = make_weights(h, e, i, dtype)
    x = torch.randn(t, h).to(dtype)
    weights, ids = moe_route(torch.randn(t, e), k, True)
    out = naive_fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == (t, h)
    assert_close("out", float64_moe(x, w13, w2, weights, ids), out, RATIO[dtype])


def token_in_batch(fn, x_row, ids_row, w_row, w13, w2, m, at, seed):
    """``x_row`` placed at ``at`` among ``m`` random tokens, half of them routed to its experts."""
    gen = generator(seed)
    e, k = w13.shape[0], ids_row.shape[0]
    x = torch.randn(m, x_row.shape[0], generator=gen).to(x_row.dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(m)]).to(torch.int32)
    ids[::2] = ids_row  # share every expert of the token under test
    weights = torch.rand(m, k, generator=gen)
    x[at], ids[at], weights[at] = x_row, ids_row, w_row
    return fn(x, w13, w2, weights, ids)[at]


def check_token_invariance(fn, dtype, sizes):
    h, e, i = 40, 6, 24
    w13, w2 = make_weights(h, e, i, dtype, seed=1)
    x_row = torch.randn(h).to(dtype)
    ids_row = torch.tensor([4, 1, 3], dtype=torch.int32)
    w_row = torch.tensor([0.5, 0.3, 0.2])
    alone = fn(x_row[None], w13, w2, w_row[None], ids_row[None])[0]
    for m in sizes:
        for at in sorted({0, m // 2, m - 1}):
            got = token_in_batch(fn, x_row, ids_row, w_row, w13, w2, m, at, seed=m * 100 + at)
            assert torch.equal(got, alone), f"T={m} at={at}: the token's output depends on its neighbours"


@pytest.mark.cpu_only  # the reference's bitwise claim is a CPU one (tests/kernels/conftest.py)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_batch_invariance(dtype):
    check_token_invariance(naive_fused_moe, dtype, [2, 3, 15, 16, 17, 33, 70])


@requires_triton
@pytest.mark.parametrize(
    "t, h, e, i, k", SHAPES, ids=[f"T{t}-H{h}-E{e}-I{i}-K{k}" for t, h, e, i, k in SHAPES]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_reference(t, h, e, i, k, dtype, device):
    w13, w2 = make_weights(h, e, i, dtype)
    x = torch.randn(t, h).to(dtype)
    weights, ids = moe_route(torch.randn(t, e), k, False)
    ref = naive_fused_moe(x, w13, w2, weights, ids)
    out = fused_moe(*(a.to(device) for a in (x, w13, w2, weights, ids)), backend="triton")
    assert out.dtype == dtype and out.shape == (t, h)
    # The Triton interpreter truncates float32 -> bfloat16 instead of rounding to nearest: five such
    # roundings per pair (gate, up, silu, product, expert output) bias its result by ~2% RMS.
    bf16_ratio = 1e-2 if out.is_cuda else 3e-2
    assert_close("out", ref, out, 1e-5 if dtype == torch.float32 else bf16_ratio)


@requires_triton
def test_triton_batch_invariance():
    def triton_fn(*args):
        return fused_moe(*args, backend="triton")

    check_token_invariance(triton_fn, torch.float32, [2, 17, 40])


@requires_triton
def test_block_table_covers_every_pair_once():
    from kernels.moe.triton_moe import moe_block_table

    gen = generator(3)
    e, bm = 7, 4
    ids = torch.randint(0, e, (13, 3), generator=gen, dtype=torch.int32)
    ids[:, 1] = 2  # one crowded expert spanning several blocks
    pairs, block_expert, start, end = moe_block_table(ids, e, bm)
    seen = []
    for b in range(block_expert.shape[0]):
        rows = pairs[start[b]:end[b]].long()
        assert len(rows) <= bm
        assert all(int(ids.view(-1)[p]) == int(block_expert[b]) for p in rows), f"block {b} mixes experts"
        seen += rows.tolist()
    assert sorted(seen) == list(range(ids.numel()))


def test_shape_checks():
    w13, w2 = make_weights(16, 3, 8, torch.float32)
    x = torch.randn(2, 16)
    weights, ids = moe_route(torch.randn(2, 3), 2, True)
    with pytest.raises(KernelInputError, match="fused_moe: w2 must be"):
        naive_fused_moe(x, w13, w2[:, :, :7], weights, ids)
    with pytest.raises(KernelInputError, match="w13 must be of x's dtype bfloat16"):
        naive_fused_moe(x.bfloat16(), w13, w2, weights, ids)
    with pytest.raises(KernelInputError, match="topk_weights must be"):
        naive_fused_moe(x, w13, w2, weights[:, :1], ids)


# ------------------------------------------------------------------------- Nemotron-H: routing

def float64_sigmoid_route(logits, bias, top_k, n_group, topk_group, renormalize, scale):
    """Token by token, in float64: the router as Nemotron-H / DeepSeek-V3 write it."""
    scores = torch.sigmoid(logits.double())
    biased = scores + bias.double()
    per_group = logits.shape[1] // n_group
    weights, ids = [], []
    for t in range(logits.shape[0]):
        group_score = [sorted(biased[t, g * per_group:(g + 1) * per_group].tolist())[-2:]
                       for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: -sum(group_score[g]))[:topk_group]
        allowed = [e for g in kept for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(allowed, key=lambda e: -biased[t, e].item())[:top_k]
        w = scores[t, chosen]
        if renormalize:
            w = w / (w.sum() + 1e-20)
        weights.append(w * scale)
        ids.append(chosen)
    return torch.stack(weights), torch.tensor(ids)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_route_matches_float64(n_group, topk_group, renormalize):
    logits, bias = torch.randn(31, 16), 0.3 * torch.randn(16)
    weights, ids = moe_route_sigmoid(logits, bias, 4, n_group=n_group, topk_group=topk_group,
                                     renormalize=renormalize, routed_scaling_factor=2.5)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and weights.shape == (31, 4)
    w64, ids64 = float64_sigmoid_route(logits, bias, 4, n_group, topk_group, renormalize, 2.5)
    assert torch.equal(ids.long(), ids64)
    torch.testing.assert_close(weights.double(), w64, rtol=1e-6, atol=1e-7)


def test_sigmoid_route_selects_on_the_bias_and_weighs_without_it():
    """Expert 2 wins only through its correction bias; its weight is its unbiased sigmoid. With groups,
    the best expert of a losing group is not chosen."""
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0])
    weights, ids = moe_route_sigmoid(logits, bias, 2, renormalize=False)
    assert ids.tolist() == [[2, 0]]
    torch.testing.assert_close(weights, torch.sigmoid(logits[:, [2, 0]]))
    # Groups {0, 1} and {2, 3}: the second group's two best biased scores sum higher.
    logits = torch.tensor([[3.0, -4.0, 1.0, 1.0]])
    _, ids = moe_route_sigmoid(logits, torch.zeros(4), 1, n_group=2, topk_group=1)
    assert ids.tolist() in ([[2]], [[3]])


def test_sigmoid_route_batch_invariance():
    """A token's routing weights are bitwise the same alone and among 37 others (the batch size moves
    it between a vectorised body and a scalar tail of the sigmoid)."""
    gen = generator(3)
    logits, bias = torch.randn(37, 24, generator=gen), 0.1 * torch.randn(24, generator=gen)
    weights, ids = moe_route_sigmoid(logits, bias, 6, routed_scaling_factor=2.5)
    for t in range(logits.shape[0]):
        w1, i1 = moe_route_sigmoid(logits[t: t + 1], bias, 6, routed_scaling_factor=2.5)
        assert torch.equal(i1, ids[t: t + 1]) and torch.equal(w1, weights[t: t + 1]), t


def test_sigmoid_route_refuses_bad_groups():
    with pytest.raises(KernelInputError, match="n_group must be a divisor of E = 6"):
        moe_route_sigmoid(torch.randn(2, 6), torch.zeros(6), 2, n_group=4, topk_group=1)
    with pytest.raises(KernelInputError, match="top_k must be an int from 1 to 3"):
        moe_route_sigmoid(torch.randn(2, 6), torch.zeros(6), 4, n_group=2, topk_group=1)


# ------------------------------------------------------------------ Nemotron-H: relu² experts

def float64_relu2_moe(x, w1, w2, weights, ids):
    x, w1, w2, weights = x.double(), w1.double(), w2.double(), weights.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            out[t] += weights[t, k] * (w2[e] @ torch.relu(w1[e] @ x[t]) ** 2)
    return out


def relu2_weights(h, e, i, dtype, seed=0):
    gen = generator(seed)
    w1 = (torch.randn(e, i, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
    return w1, w2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_relu2_reference_matches_float64(dtype):
    t, h, e, i, k = 13, 40, 6, 28, 3
    w1, w2 = relu2_weights(h, e, i, dtype)
    x = torch.randn(t, h).to(dtype)
    weights, ids = moe_route_sigmoid(torch.randn(t, e), torch.zeros(e), k, routed_scaling_factor=2.5)
    out = fused_moe(x, w1, w2, weights, ids, activation="relu2", backend="torch")
    assert out.dtype == dtype and out.shape == (t, h)
    assert_close("out", float64_relu2_moe(x, w1, w2, weights, ids), out, RATIO[dtype] * 2)


@pytest.mark.cpu_only  # the reference's bitwise claim is a CPU one (tests/kernels/conftest.py)
def test_relu2_reference_batch_invariance():
    def relu2_fn(x, w1, w2, weights, ids):
        return naive_fused_moe(x, w1, w2, weights, ids, "relu2")

    h, e, i = 40, 6, 24
    w1, w2 = relu2_weights(h, e, i, torch.float32, seed=1)
    x_row, ids_row = torch.randn(h), torch.tensor([4, 1, 3], dtype=torch.int32)
    w_row = torch.tensor([0.5, 0.3, 0.2])
    alone = relu2_fn(x_row[None], w1, w2, w_row[None], ids_row[None])[0]
    for m, at in ((3, 1), (17, 16), (40, 0)):
        assert torch.equal(token_in_batch(relu2_fn, x_row, ids_row, w_row, w1, w2, m, at, seed=m), alone)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)],
                         ids=["fp32", "bf16"])
def test_relu2_triton_matches_reference(dtype, device):
    t, h, e, i, k = 9, 48, 5, 20, 2
    w1, w2 = relu2_weights(h, e, i, dtype)
    x = torch.randn(t, h).to(dtype)
    weights, ids = moe_route_sigmoid(torch.randn(t, e), torch.zeros(e), k)
    ref = fused_moe(x, w1, w2, weights, ids, activation="relu2", backend="torch")
    out = fused_moe(*(a.to(device) for a in (x, w1, w2, weights, ids)), activation="relu2", backend="triton")
    assert out.dtype == dtype
    assert_close("out", ref, out, 1e-5 if dtype == torch.float32 else (1e-2 if out.is_cuda else 3e-2))


def test_relu2_refuses_a_gated_weight():
    w13, w2 = make_weights(16, 3, 8, torch.float32)
    weights, ids = moe_route(torch.randn(2, 3), 2, True)
    with pytest.raises(KernelInputError, match="w2 must be a float32, bfloat16 or float16 tensor of shape"):
        fused_moe(torch.randn(2, 16), w13, w2, weights, ids, activation="relu2")
    with pytest.raises(KernelInputError, match="activation must be one of"):
        fused_moe(torch.randn(2, 16), w13, w2, weights, ids, activation="gelu")


# ------------------------------------------------------- Nemotron-H: transformers as the oracle

@pytest.mark.slow
@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_sigmoid_route_and_relu2_experts_match_transformers(n_group, topk_group):
    """transformers' NemotronHTopkRouter and NemotronHExperts on the same weights: the same experts
    (as sets: transformers leaves them unsorted), the same weights, the same expert sum (float32)."""
    modeling = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    from transformers import NemotronHConfig

    t, h, e, i, k = 11, 32, 16, 24, 4
    cfg = NemotronHConfig(hidden_size=h, n_routed_experts=e, num_experts_per_tok=k, n_group=n_group,
                          topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=2.5,
                          moe_intermediate_size=i, mlp_hidden_act="relu2")
    router = modeling.NemotronHTopkRouter(cfg)
    experts = modeling.NemotronHExperts(cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.3)
        experts.up_proj.normal_(std=h ** -0.5)
        experts.down_proj.normal_(std=i ** -0.5)
        x = torch.randn(t, h)
        logits, ref_w, ref_ids = router(x)
        ref_out = experts(x, ref_ids, ref_w)
    weights, ids = moe_route_sigmoid(logits, router.e_score_correction_bias, k, n_group=n_group,
                                     topk_group=topk_group, renormalize=True, routed_scaling_factor=2.5)
    order = ref_ids.argsort(dim=-1)
    assert torch.equal(ids.long().sort(dim=-1).values, ref_ids.gather(1, order))
    torch.testing.assert_close(weights.gather(1, ids.long().argsort(dim=-1)), ref_w.gather(1, order))
    out = fused_moe(x, experts.up_proj.detach(), experts.down_proj.detach(), weights, ids, activation="relu2",
                    backend="torch")
    assert_close("experts", ref_out, out, 1e-5)
