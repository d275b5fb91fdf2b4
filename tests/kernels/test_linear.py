"""linear: the reference against float64 matmul, the Triton kernel against the reference, and
bitwise row invariance (a row alone vs among random neighbours and padding)."""

from __future__ import annotations

import pytest
import torch

from kernels._testing import assert_close
from kernels.linear import ROW_CHUNK, linear, naive_linear
from tests.kernels.conftest import requires_triton

RATIO = {torch.float32: 2e-3, torch.bfloat16: 1e-2}
SHAPES = [(1, 64, 64), (5, 128, 512), (31, 20, 70), (32, 64, 256), (33, 128, 96), (100, 12, 16)]


@pytest.mark.parametrize("m, k, n", SHAPES, ids=[f"M{m}-K{k}-N{n}" for m, k, n in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_float64(m, k, n, dtype):
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    y = naive_linear(x, w)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_close("y", x.double() @ w.double().t(), y, 1e-5 if dtype == torch.float32 else RATIO[dtype])


def test_reference_empty():
    assert naive_linear(torch.randn(0, 8), torch.randn(4, 8)).shape == (0, 4)


def row_in_batch(fn, row, w, m, at, pad):
    """``row`` placed at index ``at`` of ``m`` random rows followed by ``pad`` zero rows."""
    x = torch.cat([torch.randn(m, row.shape[1]).to(row.dtype), row.new_zeros(pad, row.shape[1])])
    x[at] = row
    return fn(x, w)[at]


@pytest.mark.parametrize("k, n", [(64, 64), (128, 512), (20, 70)], ids=["K64-N64", "K128-N512", "K20-N70"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.cpu_only
def test_reference_row_invariance(k, n, dtype):
    w = torch.randn(n, k).to(dtype)
    row = torch.randn(1, k).to(dtype)
    alone = naive_linear(row, w)[0]
    every_size = dtype == torch.float32 and k * n <= 64 * 64
    sizes = range(2, 65) if every_size else [2, 3, 17, ROW_CHUNK - 1, ROW_CHUNK, ROW_CHUNK + 1, 63, 64]
    for m in sizes:
        for at in sorted({0, 1, m // 2, m - 1}):
            for pad in (0, 3):
                got = row_in_batch(naive_linear, row, w, m, at, pad)
                assert torch.equal(got, alone), f"M={m} at={at} pad={pad}: row differs from the row alone"


@pytest.mark.cpu_only
def test_reference_row_invariance_many_chunks():
    # Several chunks in one batched matmul: the row lands in the last chunk, among 300 rows.
    w, row = torch.randn(512, 128), torch.randn(1, 128)
    alone = naive_linear(row, w)[0]
    for m, at in [(300, 299), (300, 250), (257, 128), (1000, 555)]:
        assert torch.equal(row_in_batch(naive_linear, row, w, m, at, 0), alone), f"M={m} at={at}"


TRITON_SHAPES = [(1, 64, 64), (17, 20, 70), (65, 128, 96), (3, 12, 130)]


@requires_triton
@pytest.mark.parametrize("m, k, n", TRITON_SHAPES, ids=[f"M{m}-K{k}-N{n}" for m, k, n in TRITON_SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_reference(m, k, n, dtype):
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    ref, tri = linear(x, w, backend="torch"), linear(x, w, backend="triton")
    assert tri.dtype == dtype
    assert_close("y", ref.float(), tri.float(), RATIO[dtype])


@requires_triton
def test_triton_row_strided_input():
    # Rows of x may be strided (a slice of a wider activation); the K axis must be contiguous.
    wide = torch.randn(9, 80)
    x, w = wide[:, 8:72], torch.randn(40, 64)
    assert_close("y", linear(x, w, backend="torch"), linear(x, w, backend="triton"), 2e-3)
    # A strided K axis (a transposed tensor) is copied by the wrapper: the same result.
    x_t = torch.randn(64, 9).t()
    assert_close("y", linear(x_t, w, backend="torch"), linear(x_t, w, backend="triton"), 2e-3)


@requires_triton
def test_triton_row_invariance():
    w, row = torch.randn(70, 20), torch.randn(1, 20)
    alone = linear(row, w, backend="triton")[0]
    for m, at, pad in [(2, 1, 0), (33, 32, 3), (64, 17, 0), (64, 63, 5)]:
        got = row_in_batch(lambda x, w: linear(x, w, backend="triton"), row, w, m, at, pad)
        assert torch.equal(got, alone), f"M={m} at={at} pad={pad}: row differs from the row alone"


@pytest.mark.cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_reference_half_precision_rows_do_not_depend_on_m(dtype):
    """A half-precision row gives the same bits whatever M (one chunk or several): small projections
    (N=4, as a GDN gate) over many random draws, where the CPU's half bmm varied with the chunk count."""
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        w = (torch.randn(4, 64, generator=g) * 0.1).to(dtype)
        x = torch.randn(64, 64, generator=g).to(dtype)
        full = naive_linear(x, w)
        for m in (4, 16, 20, 33):
            assert torch.equal(naive_linear(x[:m], w), full[:m]), f"M={m}"
