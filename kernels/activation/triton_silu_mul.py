"""Triton kernel for ``silu_mul``: one program per (row, block of ``BI`` columns)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import unit_stride, with_unit_stride
from kernels.activation.contract import check_silu_mul_inputs

BI = 1024  # columns per program


@triton.jit
def silu_mul_kernel(gate, up, y, I, stride_gate, stride_up, stride_y, BI: tl.constexpr):
    i_m, i_i = tl.program_id(0), tl.program_id(1)
    o_i = i_i * BI + tl.arange(0, BI)
    mask = o_i < I
    row = i_m.to(tl.int64)
    b_g = tl.load(gate + row * stride_gate + o_i, mask=mask, other=0.0).to(tl.float32)
    b_u = tl.load(up + row * stride_up + o_i, mask=mask, other=0.0).to(tl.float32)
    # As the reference: silu rounded to the inputs' dtype, then the product rounded once more.
    b_s = (b_g / (1.0 + tl.exp(-b_g))).to(y.dtype.element_ty).to(tl.float32)
    tl.store(y + row * stride_y + o_i, (b_s * b_u).to(y.dtype.element_ty), mask=mask)


def triton_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton wrapper; same contract as ``kernels.activation.silu_mul``."""
    m, i = check_silu_mul_inputs(gate, up)
    gate, up = with_unit_stride(gate), with_unit_stride(up)
    assert unit_stride(gate) and unit_stride(up), "silu_mul: gate and up need a unit stride on their last dim"
    y = torch.empty(m, i, dtype=gate.dtype, device=gate.device)
    if m * i == 0:
        return y
    silu_mul_kernel[(m, triton.cdiv(i, BI))](gate, up, y, i, gate.stride(0), up.stride(0), y.stride(0), BI=BI)
    return y
