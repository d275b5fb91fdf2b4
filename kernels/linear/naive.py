"""Reference for ``linear``: ``y = x @ weight.T`` computed in fixed-size row chunks.

The BLAS picks its blocking (and, for a single row, a different GEMV code path) from the problem
shape, so a plain ``x @ weight.T`` can give a row different bits depending on how many rows share
the call. Here every GEMM has the same shape ``[ROW_CHUNK, K] x [K, N]``: the rows are zero-padded
up to a multiple of ``ROW_CHUNK`` and the chunks go through one batched matmul with the weight
broadcast (a stride-0 batch), so each chunk is the same fixed-size GEMM. A row's result then
depends only on the row and the weight, not on M or on its neighbours (checked by
tests/kernels/test_linear.py). Half-precision inputs are multiplied in float32 and rounded once, as
the Triton kernel accumulates: the CPU's bfloat16/float16 ``bmm`` picks its reduction by the number
of chunks, so a row's bits would depend on M.
"""

from __future__ import annotations

import torch

from kernels.linear.contract import check_linear_inputs

# Rows per GEMM. Fixed: changing it may change the bits of every result. 16 trades the
# padding cost of small (decode) calls against the per-chunk cost of large ones.
ROW_CHUNK = 16


def naive_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T -> [M, N]`` in ``x.dtype``, batch-invariant per row."""
    m, k, n = check_linear_inputs(x, weight)
    num_chunks = -(-m // ROW_CHUNK)
    if num_chunks == 0:
        return x.new_empty(0, n)
    if m == num_chunks * ROW_CHUNK and x.is_contiguous():
        x_pad = x
    else:
        x_pad = x.new_zeros(num_chunks * ROW_CHUNK, k)
        x_pad[:m] = x
    w_t = weight.t().float().expand(num_chunks, k, n)
    y = torch.bmm(x_pad.float().view(num_chunks, ROW_CHUNK, k), w_t)
    return y.view(num_chunks * ROW_CHUNK, n)[:m].to(x.dtype)
