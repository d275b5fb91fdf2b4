"""rotary_embedding: the reference against the float64 rotation of each pair (and the pass-through dims
bitwise), the Triton kernel against the reference over odd shapes, strided heads and 16-bit inputs."""

from __future__ import annotations

import pytest
import torch

from kernels import KernelInputError, rotary_embedding
from kernels._testing import assert_close
from tests.kernels.conftest import requires_triton

THETA = 10000.0


def float64_rotary(x, positions, rd, theta):
    """x [T, H, D] -> pairs (i, i + rd/2) of the first rd dims turned by positions * theta^(-2i/rd)."""
    half = rd // 2
    inv = theta ** -(torch.arange(half, dtype=torch.float64) * 2 / rd)
    ang = positions.double()[:, None, None] * inv  # [T, 1, rd/2]
    a, b = x[..., :half].double(), x[..., half:rd].double()
    return torch.cat((a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin(), x[..., rd:].double()), -1)


def inputs(t, hq, hkv, d, dtype, seed=0, max_position=512):
    g = torch.Generator(device=torch.get_default_device()).manual_seed(seed)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    return q, k, torch.randint(0, max_position, (t,), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d,rd", [(16, 16), (24, 8)], ids=["full", "partial"])
def test_reference_rotates_pairs(dtype, d, rd):
    q, k, pos = inputs(9, 3, 1, d, dtype)
    rq, rk = rotary_embedding(q, k, pos, rd, THETA, backend="torch")
    assert rq.dtype == rk.dtype == dtype and rq.shape == q.shape and rk.shape == k.shape
    assert torch.equal(rq[..., rd:], q[..., rd:]) and torch.equal(rk[..., rd:], k[..., rd:])
    ratio = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close("q", float64_rotary(q, pos, rd, THETA), rq.double(), ratio)
    assert_close("k", float64_rotary(k, pos, rd, THETA), rk.double(), ratio)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,hq,hkv,d,rd", [(1, 1, 1, 4, 4), (7, 5, 1, 24, 16), (13, 6, 2, 12, 6)],
                         ids=["T1-D4", "T7-Hq5-partial", "T13-rd6"])
def test_triton_matches_reference(dtype, t, hq, hkv, d, rd):
    q, k, pos = inputs(t, hq, hkv, d, dtype, seed=t)
    ref = rotary_embedding(q, k, pos, rd, THETA, backend="torch")
    out = rotary_embedding(q, k, pos, rd, THETA, backend="triton")
    for name, x, r, o in (("q", q, ref[0], out[0]), ("k", k, ref[1], out[1])):
        assert o.dtype == dtype and o.shape == x.shape and o.is_contiguous()
        assert torch.equal(o[..., rd:], x[..., rd:]), f"{name}: the pass-through dims changed"
        # float32: the kernel's exp2 frequencies and the reference's pow are a few ulps apart (the angle's
        # error grows with the position); 16-bit: cos, sin and each product round to neighbouring values
        assert_close(name, r.float(), o.float(), 2e-5 if dtype == torch.float32 else 2e-2)


@requires_triton
def test_triton_strided_heads():
    qg = torch.randn(5, 3, 2 * 16)  # q as the first half of each head's [q | gate] (GatedAttention)
    q, k, pos = qg[..., :16], torch.randn(5, 1, 16), torch.arange(5) * 37
    for r, o in zip(rotary_embedding(q, k, pos, 8, THETA, backend="torch"),
                    rotary_embedding(q, k, pos, 8, THETA, backend="triton")):
        assert_close("rotated", r, o, 2e-5)


@pytest.mark.parametrize("change,match", [
    ({"rotary_dim": 7}, "rotary_embedding: rotary_dim must be an even int from 2 to D = 16, got 7"),
    ({"rotary_dim": 18}, "rotary_embedding: rotary_dim must be an int from 2 to 16, got 18"),
    ({"theta": 0.0}, "rotary_embedding: theta must be a float > 0, got 0.0"),
])
def test_refuses_bad_rotations(change, match):
    q, k, pos = inputs(2, 1, 1, 16, torch.float32)
    args = {"rotary_dim": 16, "theta": THETA} | change
    with pytest.raises(KernelInputError, match=match.replace("(", "\\(").replace(")", "\\)")):
        rotary_embedding(q, k, pos, **args)


def test_refuses_k_of_another_dtype():
    q, k, pos = inputs(2, 1, 1, 16, torch.float32)
    with pytest.raises(KernelInputError, match="rotary_embedding: k must be q's dtype"):
        rotary_embedding(q, k.bfloat16(), pos, 16, THETA)
