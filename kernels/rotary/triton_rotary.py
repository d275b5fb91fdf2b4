"""Triton kernel for ``rotary_embedding``: one program per (token, block of ``BH`` heads), q's heads then
k's, each turning all ``rotary_dim / 2`` pairs of its heads."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._contract import unit_stride, with_unit_stride
from kernels.rotary.contract import check_rotary_inputs

BH = 4  # heads per program


@triton.jit
def rotary_kernel(
    x, y, positions, H, stride_x_t, stride_x_h, stride_y_t, stride_y_h, log2_theta,
    D: tl.constexpr, HALF: tl.constexpr, BHALF: tl.constexpr, BREST: tl.constexpr, BH: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)
    o_i = tl.arange(0, BHALF)
    mask_h, mask_i = o_h < H, o_i < HALF
    mask = mask_h[:, None] & mask_i[None, :]
    b_pos = tl.load(positions + i_t).to(tl.float32)
    # theta^(-2i/rd) in float32 (as exp2, log2(theta) from the host in float64), the angle rounded once, cos
    # and sin rounded to the dtype, as the reference
    b_inv = tl.exp2(-(o_i.to(tl.float32) / HALF) * log2_theta)
    b_ang = b_pos * b_inv
    b_cos = tl.cos(b_ang).to(y.dtype.element_ty).to(tl.float32)[None, :]
    b_sin = tl.sin(b_ang).to(y.dtype.element_ty).to(tl.float32)[None, :]
    p_x = x + i_t.to(tl.int64) * stride_x_t + o_h[:, None] * stride_x_h
    p_y = y + i_t.to(tl.int64) * stride_y_t + o_h[:, None] * stride_y_h
    b_a = tl.load(p_x + o_i[None, :], mask=mask, other=0.0).to(tl.float32)  # dims [0, rd/2)
    b_b = tl.load(p_x + HALF + o_i[None, :], mask=mask, other=0.0).to(tl.float32)  # dims [rd/2, rd)
    dt = y.dtype.element_ty
    # a * cos - b * sin and b * cos + a * sin, each product and the sum rounded to the dtype
    b_lo = ((b_a * b_cos).to(dt).to(tl.float32) + (b_b * -b_sin).to(dt).to(tl.float32)).to(dt)
    b_hi = ((b_b * b_cos).to(dt).to(tl.float32) + (b_a * b_sin).to(dt).to(tl.float32)).to(dt)
    tl.store(p_y + o_i[None, :], b_lo, mask=mask)
    tl.store(p_y + HALF + o_i[None, :], b_hi, mask=mask)
    if BREST > 0:  # the dims past rotary_dim pass through
        o_r = tl.arange(0, BREST)
        mask_r = mask_h[:, None] & (o_r < D - 2 * HALF)[None, :]
        b_r = tl.load(p_x + 2 * HALF + o_r[None, :], mask=mask_r, other=0.0)
        tl.store(p_y + 2 * HALF + o_r[None, :], b_r, mask=mask_r)


def _launch(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    t, h, d = x.shape
    x = with_unit_stride(x)
    assert unit_stride(x), "rotary_embedding: q and k need a unit stride on D"
    y = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    if t * h == 0:
        return y
    half, rest = rotary_dim // 2, d - rotary_dim
    rotary_kernel[(t, triton.cdiv(h, BH))](
        x, y, positions, h, x.stride(0), x.stride(1), y.stride(0), y.stride(1), math.log2(theta),
        D=d, HALF=half, BHALF=triton.next_power_of_2(half), BREST=triton.next_power_of_2(rest) if rest else 0,
        BH=BH,
    )
    return y


def triton_rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
                            theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton wrapper; same contract as ``kernels.rotary.rotary_embedding``."""
    check_rotary_inputs(q, k, positions, rotary_dim, theta)
    positions = positions if positions.is_contiguous() else positions.contiguous()
    return _launch(q, positions, rotary_dim, theta), _launch(k, positions, rotary_dim, theta)
