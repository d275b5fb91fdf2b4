"""relu2: the reference against relu(x)^2 in float64 and in the input dtype, the Triton kernel against
the reference (bitwise), and transformers' ``relu2`` activation as the oracle."""

from __future__ import annotations

import pytest
import torch

from kernels import KernelInputError, relu2
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
