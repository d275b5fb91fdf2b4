"""Triton kernels for ``rms_norm``, ``gated_rms_norm`` and ``gated_group_rms_norm``: one program per
normalised row (or group of a row)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import as_contiguous, unit_stride, with_unit_stride
from kernels.norm.contract import (
    check_gated_group_rms_norm_inputs,
    check_gated_rms_norm_inputs,
    check_rms_norm_inputs,
)


@triton.jit
def rms_norm_kernel(
    x, w, y, eps, stride_x, stride_y,
    H: tl.constexpr, BH: tl.constexpr, ZERO_CENTERED: tl.constexpr,
):
    i_m = tl.program_id(0)
    o_h = tl.arange(0, BH)
    mask_h = o_h < H
    b_x = tl.load(x + i_m * stride_x + o_h, mask=mask_h, other=0.0).to(tl.float32)
    b_w = tl.load(w + o_h, mask=mask_h, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        b_w = 1.0 + b_w
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, 0) / H + eps)
    b_y = b_x * b_rstd * b_w
    tl.store(y + i_m * stride_y + o_h, b_y.to(y.dtype.element_ty), mask=mask_h)


@triton.jit
def gated_rms_norm_kernel(
    x, z, w, y, eps,
    D: tl.constexpr, BD: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
):
    # One program per (token, value head) row of D elements; x, z, y contiguous [M, Hv, D].
    i_r = tl.program_id(0)
    o_d = tl.arange(0, BD)
    mask_d = o_d < D
    b_x = tl.load(x + i_r * D + o_d, mask=mask_d, other=0.0).to(tl.float32)
    b_z = tl.load(z + i_r * D + o_d, mask=mask_d, other=0.0).to(tl.float32)
    b_w = tl.load(w + o_d, mask=mask_d, other=0.0).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, 0) / D + eps)
    # As in the reference: the normalised value is rounded to x's dtype, and the weight product
    # too when torch would compute it in x's dtype (16-bit weight), before the float32 gate.
    b_g = b_w * (b_x * b_rstd).to(y.dtype.element_ty).to(tl.float32)
    if ROUND_PRODUCT:
        b_g = b_g.to(y.dtype.element_ty).to(tl.float32)
    b_y = b_g * (b_z / (1.0 + tl.exp(-b_z)))
    tl.store(y + i_r * D + o_d, b_y.to(y.dtype.element_ty), mask=mask_d)


@triton.jit
def gated_group_rms_norm_kernel(
    x, z, w, y, eps, stride_x, stride_z, stride_y,
    GROUPS: tl.constexpr, GS: tl.constexpr, BG: tl.constexpr,
):
    # One program per (row, group of GS channels); gate first, then the norm over the group.
    i_m, i_g = tl.program_id(0) // GROUPS, tl.program_id(0) % GROUPS
    o_c = i_g * GS + tl.arange(0, BG)
    mask_c = tl.arange(0, BG) < GS
    b_x = tl.load(x + i_m * stride_x + o_c, mask=mask_c, other=0.0).to(tl.float32)
    b_z = tl.load(z + i_m * stride_z + o_c, mask=mask_c, other=0.0).to(tl.float32)
    b_w = tl.load(w + o_c, mask=mask_c, other=0.0).to(tl.float32)
    b_g = b_x * (b_z / (1.0 + tl.exp(-b_z)))
    b_rstd = tl.rsqrt(tl.sum(b_g * b_g, 0) / GS + eps)
    # As in the reference: the normalised value is rounded to x's dtype before the weight multiply.
    b_y = b_w * (b_g * b_rstd).to(y.dtype.element_ty).to(tl.float32)
    tl.store(y + i_m * stride_y + o_c, b_y.to(y.dtype.element_ty), mask=mask_c)


def triton_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centered: bool = True
) -> torch.Tensor:
    """Triton wrapper; same contract as ``kernels.norm.rms_norm``."""
    m, h = check_rms_norm_inputs(x, weight, eps, zero_centered)
    x, weight = with_unit_stride(x), with_unit_stride(weight)
    assert unit_stride(x) and unit_stride(weight), "rms_norm: rows of x and weight must be contiguous"
    y = torch.empty(m, h, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    rms_norm_kernel[(m,)](
        x, weight, y, eps, x.stride(0), y.stride(0),
        H=h, BH=triton.next_power_of_2(h), ZERO_CENTERED=zero_centered,
    )
    return y


def triton_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton wrapper; same contract as ``kernels.norm.gated_rms_norm``."""
    m, hv, d = check_gated_rms_norm_inputs(x, z, weight, eps)
    x, z, weight = as_contiguous(x), as_contiguous(z), as_contiguous(weight)
    assert x.is_contiguous() and z.is_contiguous() and weight.is_contiguous(), "gated_rms_norm: contiguous"
    y = torch.empty(m, hv, d, dtype=x.dtype, device=x.device)
    if m * hv == 0:
        return y
    round_product = x.dtype != torch.float32 and torch.promote_types(weight.dtype, x.dtype) == x.dtype
    gated_rms_norm_kernel[(m * hv,)](
        x, z, weight, y, eps, D=d, BD=triton.next_power_of_2(d), ROUND_PRODUCT=round_product,
    )
    return y


def triton_gated_group_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> torch.Tensor:
    """Triton wrapper; same contract as ``kernels.norm.gated_group_rms_norm``."""
    m, width = check_gated_group_rms_norm_inputs(x, z, weight, eps, group_size)
    x, z, weight = with_unit_stride(x), with_unit_stride(z), with_unit_stride(weight)
    assert unit_stride(x) and unit_stride(z) and unit_stride(weight), "gated_group_rms_norm: unit strides"
    y = torch.empty(m, width, dtype=x.dtype, device=x.device)
    if m * width == 0:
        return y
    groups = width // group_size
    gated_group_rms_norm_kernel[(m * groups,)](
        x, z, weight, y, eps, x.stride(0), z.stride(0), y.stride(0),
        GROUPS=groups, GS=group_size, BG=triton.next_power_of_2(group_size),
    )
    return y
