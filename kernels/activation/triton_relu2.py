"""Triton kernel for ``relu2``: one program per (row, block of ``BH`` columns)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import unit_stride, with_unit_stride
from kernels.activation.contract import check_relu2_inputs

BH = 1024  # columns per program


@triton.jit
def relu2_kernel(x, y, H, stride_x, stride_y, BH: tl.constexpr):
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)
    mask = o_h < H
    b_x = tl.load(x + i_m.to(tl.int64) * stride_x + o_h, mask=mask, other=0.0).to(tl.float32)
    b_r = tl.where(b_x < 0.0, 0.0, b_x)  # NaN stays NaN, as torch.clamp_min
    tl.store(y + i_m.to(tl.int64) * stride_y + o_h, (b_r * b_r).to(y.dtype.element_ty), mask=mask)


def triton_relu2(x: torch.Tensor) -> torch.Tensor:
    """Triton wrapper; same contract as ``kernels.activation.relu2``."""
    m, h = check_relu2_inputs(x)
    x = with_unit_stride(x)
    assert unit_stride(x), "relu2: x needs a unit stride on its last dimension"
    y = torch.empty(m, h, dtype=x.dtype, device=x.device)
    if m * h == 0:
        return y
    relu2_kernel[(m, triton.cdiv(h, BH))](x, y, h, x.stride(0), y.stride(0), BH=BH)
    return y
