"""gdn_gating: the reference against the float64 gates (softplus's threshold included), row by row, and
the Triton kernel against the reference over odd shapes, strided projections and the extremes."""

from __future__ import annotations

import pytest
import torch

from kernels import KernelInputError, gdn_gating
from tests.kernels.conftest import requires_triton


def float64_gates(a_log, a, dt_bias, b):
    x = a.double() + dt_bias.double()
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    return -torch.exp(a_log.double()) * softplus, 1 / (1 + torch.exp(-b.double()))


def inputs(t, hv, dtype, seed=0):
    g = torch.Generator(device=torch.get_default_device()).manual_seed(seed)
    a = (6 * torch.randn(t, hv, generator=g)).to(dtype)
    b = (4 * torch.randn(t, hv, generator=g)).to(dtype)
    a_log, dt_bias = torch.randn(hv, generator=g), torch.randn(hv, generator=g)
    if t > 2:  # the extremes: softplus's identity above 20, an exp that underflows, a saturated sigmoid
        a[0, 0], a[1, 0], b[2, 0] = 30.0, -90.0, -100.0
    return a_log, a, dt_bias, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_gates(dtype):
    a_log, a, dt_bias, b = inputs(9, 5, dtype)
    g, beta = gdn_gating(a_log, a, dt_bias, b, backend="torch")
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == (9, 5)
    g64, beta64 = float64_gates(a_log, a, dt_bias, b)
    assert torch.allclose(g.double(), g64, rtol=1e-5, atol=1e-30)
    assert torch.allclose(beta.double(), beta64, rtol=1e-5, atol=1e-30)
    assert (g <= 0).all() and ((beta >= 0) & (beta <= 1)).all()


@pytest.mark.cpu_only
def test_reference_row_invariance():
    a_log, a, dt_bias, b = inputs(1, 6, torch.float32, seed=1)
    g1, beta1 = gdn_gating(a_log, a, dt_bias, b, backend="torch")
    for t in (2, 9, 40):
        _, ma, _, mb = inputs(t, 6, torch.float32, seed=t)
        ma[t // 2], mb[t // 2] = a[0], b[0]
        g, beta = gdn_gating(a_log, ma, dt_bias, mb, backend="torch")
        assert torch.equal(g[t // 2], g1[0]) and torch.equal(beta[t // 2], beta1[0]), f"T={t}"


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,hv", [(1, 3), (37, 5), (16, 32)], ids=["T1-Hv3", "T37-Hv5", "T16-Hv32"])
def test_triton_matches_reference(dtype, t, hv):
    a_log, a, dt_bias, b = inputs(t, hv, dtype, seed=t)
    ref_g, ref_beta = gdn_gating(a_log, a, dt_bias, b, backend="torch")
    g, beta = gdn_gating(a_log, a, dt_bias, b, backend="triton")
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == (t, hv)
    assert torch.allclose(g, ref_g, rtol=1e-5, atol=1e-30), (g - ref_g).abs().max()
    assert torch.allclose(beta, ref_beta, rtol=1e-5, atol=1e-30), (beta - ref_beta).abs().max()


@requires_triton
def test_triton_strided_projections():
    a_log, _, dt_bias, _ = inputs(1, 4, torch.float32)
    ab = 3 * torch.randn(11, 8)  # a and b as the halves of one projection: row stride 8
    a, b = ab[:, :4], ab[:, 4:]
    for ref, out in zip(gdn_gating(a_log, a, dt_bias, b, backend="torch"),
                        gdn_gating(a_log, a, dt_bias, b, backend="triton")):
        assert torch.allclose(ref, out, rtol=1e-5, atol=1e-30)


def test_refuses_mismatched_heads():
    a_log, a, dt_bias, b = inputs(3, 4, torch.float32)
    with pytest.raises(KernelInputError, match="gdn_gating: dt_bias must be"):
        gdn_gating(a_log, a, dt_bias[:3], b)
