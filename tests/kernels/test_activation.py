"""relu2: the reference against relu(x)^2 in float64 and in the input dtype, the Triton kernel against
the reference (bitwise), and transformers' ``relu2`` activation as the oracle. silu_mul: the reference
against the SwiGLU product it replaces in the model, in float64 and row by row, the Triton kernel
against the reference over odd shapes."""

from __future__ import annotations

import pytest
import torch

from kernels import KernelInputError, relu2, silu_mul
from tests.kernels.conftest import requires_triton

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                                 ids=["fp32", "bf16", "fp16"])


@DTYPES
def test_reference_is_relu_squared(dtype):
    x = (3 * torch.randn(7, 33)).to(dtype)
    x[0, :3] = torch.tensor([-0.0, 0.0, float("nan")])
    y = relu2(x, backend="torch")
    assert y.dtype == dtype and y.shape == x.shape
    # One rounding of the float32 square: what a 16-bit torch square gives too.
    expect = torch.square(torch.relu(x))
    assert torch.equal(y[:, 3:], expect[:, 3:]) and torch.equal(y[0, :2], torch.zeros(2, dtype=dtype))
    assert torch.isnan(y[0, 2])
    rtol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(y[:, 3:].double(), torch.relu(x[:, 3:].double()) ** 2, rtol=rtol)


@requires_triton
@DTYPES
@pytest.mark.parametrize("m,h", [(1, 5), (4, 1100)], ids=["M1-H5", "M4-H1100"])
def test_triton_matches_reference(dtype, m, h):
    x = (3 * torch.randn(m, h)).to(dtype)
    ref, out = relu2(x, backend="torch"), relu2(x, backend="triton")
    assert out.dtype == dtype
    # Under the interpreter a float32 -> 16-bit store truncates where torch rounds: one ulp apart at most.
    if dtype == torch.float32 or out.is_cuda:
        assert torch.equal(ref, out)
    else:
        assert torch.allclose(ref.float(), out.float(), rtol=1e-2, atol=0)


@requires_triton
def test_triton_strided_rows():
    wide = torch.randn(5, 40)
    x = wide[:, :33]
    assert torch.equal(relu2(x, backend="torch"), relu2(x, backend="triton"))


def test_refuses_a_vector():
    with pytest.raises(KernelInputError, match="relu2: x must be a float32, bfloat16 or float16 tensor"):
        relu2(torch.randn(5))


@pytest.mark.slow
@DTYPES
def test_matches_transformers_relu2(dtype):
    activations = pytest.importorskip("transformers.activations")
    x = (3 * torch.randn(9, 65)).to(dtype)
    assert torch.equal(relu2(x, backend="torch"), activations.ACT2FN["relu2"](x))


@DTYPES
def test_silu_mul_reference_is_swiglu(dtype):
    gate, up = (4 * torch.randn(6, 37)).to(dtype), torch.randn(6, 37).to(dtype)
    y = silu_mul(gate, up, backend="torch")
    assert y.dtype == dtype and y.shape == gate.shape
    g64 = gate.double()
    expect = g64 * torch.sigmoid(g64) * up.double()
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.double(), expect, rtol=rtol, atol=1e-6)


@pytest.mark.cpu_only
def test_silu_mul_reference_row_invariance():
    gate, up = 4 * torch.randn(1, 45), torch.randn(1, 45)
    alone = silu_mul(gate, up, backend="torch")
    for m in (2, 7, 33):
        g, u = 4 * torch.randn(m, 45), torch.randn(m, 45)
        g[m // 2], u[m // 2] = gate[0], up[0]
        assert torch.equal(silu_mul(g, u, backend="torch")[m // 2], alone[0]), f"M={m}"


@requires_triton
@DTYPES
@pytest.mark.parametrize("m,i", [(1, 3), (5, 1030)], ids=["M1-I3", "M5-I1030"])
def test_silu_mul_triton_matches_reference(dtype, m, i):
    gate, up = (4 * torch.randn(m, i)).to(dtype), torch.randn(m, i).to(dtype)
    ref, out = silu_mul(gate, up, backend="torch"), silu_mul(gate, up, backend="triton")
    assert out.dtype == dtype and out.shape == (m, i)
    # two roundings to the dtype (the silu, the product): an ulp of each apart under the interpreter
    rtol = 1e-6 if dtype == torch.float32 else 2e-2
    assert torch.allclose(ref.float(), out.float(), rtol=rtol, atol=1e-6)


@requires_triton
def test_silu_mul_triton_strided_rows():
    both = torch.randn(4, 2, 50)  # gate and up as the halves of one projection: row stride 100
    gate, up = both[:, 0, :], both[:, 1, :]
    assert torch.allclose(silu_mul(gate, up, backend="torch"), silu_mul(gate, up, backend="triton"),
                          rtol=1e-6, atol=1e-6)


def test_silu_mul_refuses_mixed_dtypes():
    with pytest.raises(KernelInputError, match="silu_mul: up must be gate's dtype \\(float32\\)"):
        silu_mul(torch.randn(2, 4), torch.randn(2, 4).to(torch.bfloat16))
