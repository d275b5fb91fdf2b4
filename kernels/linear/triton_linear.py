"""Triton kernel for ``linear``: ``y = x @ weight.T``, one program per [BM, BN] output tile.

Each program runs the whole K loop itself in a fixed order (no split-K) and the tile sizes do not
depend on M, so a row's result does not depend on how many rows share the call.

How a tile product is formed (``MATMUL``): on the GPU a ``tl.dot``, in IEEE float32 for float32
inputs (no TF32) and with a float32 accumulator for 16-bit inputs. Under the Triton interpreter
(CPU tensors) the products are summed with ``tl.sum`` instead: the interpreter runs ``tl.dot`` as a
NumPy matmul whose BLAS can give a row different bits at different row positions, and it gets
16-bit dots wrong.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import unit_stride, with_unit_stride
from kernels.linear.contract import check_linear_inputs

# Fixed tile sizes (never chosen from M: that would break batch invariance).
BM, BN, BK = 32, 64, 32


@triton.jit(do_not_specialize=["M"])
def linear_kernel(
    x, w, y, M, N, K,
    stride_xm, stride_wn, stride_ym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MATMUL: tl.constexpr,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    mask_m, mask_n = o_m < M, o_n < N
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        mask_k = o_k < K
        p_x = x + o_m[:, None] * stride_xm + o_k[None, :]
        p_w = w + o_n[None, :] * stride_wn + o_k[:, None]
        b_x = tl.load(p_x, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b_w = tl.load(p_w, mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # [BK, BN] = W^T tile
        if MATMUL == "products":
            b_acc += tl.sum(b_x.to(tl.float32)[:, :, None] * b_w.to(tl.float32)[None, :, :], 1)
        elif MATMUL == "dot_fp32":
            b_acc = tl.dot(b_x, b_w, b_acc, input_precision="ieee")
        else:
            b_acc = tl.dot(b_x, b_w, b_acc)
    p_y = y + o_m[:, None] * stride_ym + o_n[None, :]
    tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def linear_matmul(x: torch.Tensor) -> str:
    if not x.is_cuda:
        return "products"
    return "dot_fp32" if x.dtype == torch.float32 else "dot"


def triton_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Triton wrapper; same contract as ``kernels.linear.linear``."""
    m, k, n = check_linear_inputs(x, weight)
    x, weight = with_unit_stride(x), with_unit_stride(weight)
    assert unit_stride(x) and unit_stride(weight), "linear: the K axis of x and weight must be contiguous"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    grid = (triton.cdiv(m, BM), triton.cdiv(n, BN))
    linear_kernel[grid](
        x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BM=BM, BN=BN, BK=BK, MATMUL=linear_matmul(x),
    )
    return y
