"""rms_norm / gated_rms_norm: the references against independent float64 formulas, the Triton
kernels against the references, and bitwise row invariance of the references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels._testing import assert_close
from kernels.norm import gated_group_rms_norm, gated_rms_norm, naive_gated_rms_norm, naive_rms_norm, rms_norm
from tests.kernels.conftest import requires_triton

EPS = 1e-6
RATIO = {torch.float32: 2e-3, torch.bfloat16: 2e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def rms_norm_float64(x, weight, zero_centered):
    x64 = x.double()
    y = x64 / (x64.pow(2).mean(-1, keepdim=True) + EPS).sqrt()
    return y * (1 + weight.double() if zero_centered else weight.double())


def gated_rms_norm_float64(x, z, weight):
    x64 = x.double()
    y = x64 / (x64.pow(2).mean(-1, keepdim=True) + EPS).sqrt()
    return weight.double() * y * F.silu(z.double())


@pytest.mark.parametrize("h", [12, 64, 100])
@pytest.mark.parametrize("zero_centered", [True, False], ids=["zc", "plain"])
@DTYPES
def test_rms_norm_reference(h, zero_centered, dtype):
    x, w = (3 * torch.randn(7, h)).to(dtype), (0.5 * torch.randn(h)).to(dtype)
    y = naive_rms_norm(x, w, EPS, zero_centered=zero_centered)
    assert y.dtype == dtype
    assert_close("y", rms_norm_float64(x, w, zero_centered), y, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dv", [12, 16, 20])
@DTYPES
def test_gated_rms_norm_reference(dv, dtype):
    x, z = torch.randn(5, 3, dv).to(dtype), (4 * torch.randn(5, 3, dv)).to(dtype)
    w = torch.randn(dv).to(dtype)
    y = naive_gated_rms_norm(x, z, w, EPS)
    assert y.dtype == dtype
    assert_close("y", gated_rms_norm_float64(x, z, w), y, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.cpu_only
def test_reference_row_invariance():
    h, hv, dv = 64, 4, 20
    w, wg = torch.randn(h), torch.randn(dv)
    row, rx, rz = torch.randn(1, h), torch.randn(1, hv, dv), 5 * torch.randn(1, hv, dv)
    alone = naive_rms_norm(row, w, EPS)
    alone_g = naive_gated_rms_norm(rx, rz, wg, EPS)
    # Sizes past 32768 elements make torch split elementwise ops across threads.
    for m, at in [(2, 1), (17, 9), (64, 63), (700, 333), (3000, 2999)]:
        x = torch.randn(m, h)
        x[at] = row[0]
        assert torch.equal(naive_rms_norm(x, w, EPS)[at], alone[0]), f"rms_norm M={m} at={at}"
        gx, gz = torch.randn(m, hv, dv), 5 * torch.randn(m, hv, dv)
        gx[at], gz[at] = rx[0], rz[0]
        assert torch.equal(naive_gated_rms_norm(gx, gz, wg, EPS)[at], alone_g[0]), f"gated M={m} at={at}"


@requires_triton
@pytest.mark.parametrize("m, h", [(1, 64), (9, 12), (33, 100)], ids=["M1-H64", "M9-H12", "M33-H100"])
@pytest.mark.parametrize("zero_centered", [True, False], ids=["zc", "plain"])
@DTYPES
def test_triton_rms_norm(m, h, zero_centered, dtype):
    x, w = (3 * torch.randn(m, h)).to(dtype), (0.5 * torch.randn(h)).to(dtype)
    ref = rms_norm(x, w, EPS, zero_centered=zero_centered, backend="torch")
    tri = rms_norm(x, w, EPS, zero_centered=zero_centered, backend="triton")
    assert tri.dtype == dtype
    assert_close("y", ref.float(), tri.float(), RATIO[dtype])


@requires_triton
@pytest.mark.parametrize(
    "m, hv, dv", [(1, 2, 16), (7, 3, 12), (20, 4, 20)], ids=["M1-D16", "M7-D12", "M20-D20"]
)
@pytest.mark.parametrize("weight_dtype", [None, torch.float32], ids=["w-same", "w-fp32"])
@DTYPES
def test_triton_gated_rms_norm(m, hv, dv, weight_dtype, dtype):
    x, z = torch.randn(m, hv, dv).to(dtype), (4 * torch.randn(m, hv, dv)).to(dtype)
    w = torch.randn(dv).to(weight_dtype or dtype)
    ref = gated_rms_norm(x, z, w, EPS, backend="torch")
    tri = gated_rms_norm(x, z, w, EPS, backend="triton")
    assert tri.dtype == dtype
    assert_close("y", ref.float(), tri.float(), RATIO[dtype])


@requires_triton
def test_triton_rms_norm_strided_rows():
    wide = torch.randn(6, 80)
    x, w = wide[:, :64], torch.randn(64)
    assert_close("y", rms_norm(x, w, EPS, backend="torch"), rms_norm(x, w, EPS, backend="triton"), 2e-3)
    # A strided H axis (a transposed tensor) is copied by the wrapper: the same result.
    x_t = torch.randn(64, 6).t()
    assert_close("y", rms_norm(x_t, w, EPS, backend="torch"), rms_norm(x_t, w, EPS, backend="triton"), 2e-3)


# ------------------------------------------------------------ gated group norm (Mamba2, gate first)

def gated_group_rms_norm_float64(x, z, weight, group_size):
    g = x.double() * F.silu(z.double())
    grouped = g.view(g.shape[0], -1, group_size)
    y = grouped / (grouped.pow(2).mean(-1, keepdim=True) + EPS).sqrt()
    return weight.double() * y.view_as(g)


@pytest.mark.parametrize("width,group_size", [(24, 8), (40, 40), (96, 32)])
@DTYPES
def test_gated_group_rms_norm_reference(width, group_size, dtype):
    x, z = (3 * torch.randn(5, width)).to(dtype), (2 * torch.randn(5, width)).to(dtype)
    w = torch.randn(width).to(dtype)
    y = gated_group_rms_norm(x, z, w, EPS, group_size, backend="torch")
    assert y.dtype == dtype
    assert_close("y", gated_group_rms_norm_float64(x, z, w, group_size), y,
                 1e-5 if dtype == torch.float32 else 1e-2)


def test_gated_group_rms_norm_groups_are_independent():
    """Scaling one group's input leaves the other groups' outputs unchanged: the norm is per group."""
    x, z, w = torch.randn(3, 24), torch.randn(3, 24), torch.randn(24)
    y = gated_group_rms_norm(x, z, w, EPS, 8, backend="torch")
    x2 = x.clone()
    x2[:, 8:16] *= 10.0
    y2 = gated_group_rms_norm(x2, z, w, EPS, 8, backend="torch")
    assert torch.equal(y[:, :8], y2[:, :8]) and torch.equal(y[:, 16:], y2[:, 16:])
    assert not torch.allclose(gated_group_rms_norm(x, z, w, EPS, 24, backend="torch"), y)


@pytest.mark.cpu_only
def test_gated_group_rms_norm_reference_row_invariance():
    x, z, w = torch.randn(1, 64), 5 * torch.randn(1, 64), torch.randn(64)
    alone = gated_group_rms_norm(x, z, w, EPS, 16, backend="torch")
    for m in (2, 17, 64):
        at = m // 2
        bx, bz = torch.randn(m, 64), torch.randn(m, 64)
        bx[at], bz[at] = x[0], z[0]
        assert torch.equal(gated_group_rms_norm(bx, bz, w, EPS, 16, backend="torch")[at], alone[0])


GROUP_NORM_CASES = [  # M, I, group size, weight dtype (None: x's), x dtype
    pytest.param(3, 48, 12, None, torch.float32, id="M3-I48-G4-fp32"),
    pytest.param(3, 48, 12, torch.float32, torch.bfloat16, id="M3-I48-G4-bf16-w-fp32"),
    pytest.param(1, 16, 16, None, torch.bfloat16, id="M1-I16-G1-bf16", marks=pytest.mark.slow),
    pytest.param(7, 40, 8, torch.float32, torch.float32, id="M7-I40-G5-fp32-w-fp32", marks=pytest.mark.slow),
    pytest.param(7, 40, 8, None, torch.bfloat16, id="M7-I40-G5-bf16", marks=pytest.mark.slow),
]


@requires_triton
@pytest.mark.parametrize("m,width,group_size,weight_dtype,dtype", GROUP_NORM_CASES)
def test_triton_gated_group_rms_norm(m, width, group_size, weight_dtype, dtype):
    x, z = torch.randn(m, width).to(dtype), (4 * torch.randn(m, width)).to(dtype)
    w = torch.randn(width).to(weight_dtype or dtype)
    ref = gated_group_rms_norm(x, z, w, EPS, group_size, backend="torch")
    tri = gated_group_rms_norm(x, z, w, EPS, group_size, backend="triton")
    assert tri.dtype == dtype
    assert_close("y", ref.float(), tri.float(), RATIO[dtype])


@pytest.mark.slow
@DTYPES
def test_gated_group_rms_norm_matches_transformers(dtype):
    """transformers' NemotronHRMSNormGated (gate before the norm, groups of I / n_groups)."""
    modeling = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    width, group_size = 64, 16
    norm = modeling.NemotronHRMSNormGated(width, group_size=group_size, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x, z = torch.randn(6, width).to(dtype), torch.randn(6, width).to(dtype)
    with torch.no_grad():
        ref = norm(x, z)
    out = gated_group_rms_norm(x, z, norm.weight.detach(), 1e-5, group_size, backend="torch")
    assert_close("y", ref.float(), out.float(), 1e-6 if dtype == torch.float32 else 1e-2)
