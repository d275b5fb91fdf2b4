"""Triton kernel for ``gdn_gating``: one program per block of ``BT`` tokens, all ``Hv`` heads of each."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import unit_stride, with_unit_stride
from kernels.activation.naive import SOFTPLUS_THRESHOLD
from kernels.gdn_gating.contract import check_gdn_gating_inputs

BT = 16  # tokens per program


@triton.jit
def gdn_gating_kernel(
    a_log, a, dt_bias, b, g, beta, T, stride_a, stride_b,
    HV: tl.constexpr, BHV: tl.constexpr, BT: tl.constexpr, THRESHOLD: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_t = i_t * BT + tl.arange(0, BT)
    o_h = tl.arange(0, BHV)
    mask_t, mask_h = o_t < T, o_h < HV
    mask = mask_t[:, None] & mask_h[None, :]
    rows = o_t.to(tl.int64)[:, None]
    b_a = tl.load(a + rows * stride_a + o_h[None, :], mask=mask, other=0.0).to(tl.float32)
    b_b = tl.load(b + rows * stride_b + o_h[None, :], mask=mask, other=0.0).to(tl.float32)
    b_alog = tl.load(a_log + o_h, mask=mask_h, other=0.0).to(tl.float32)
    b_dt = tl.load(dt_bias + o_h, mask=mask_h, other=0.0).to(tl.float32)
    b_x = b_a + b_dt[None, :]
    b_e = tl.exp(tl.minimum(b_x, THRESHOLD))
    b_u = 1.0 + b_e
    # log1p(e) to about an ulp: log(u) scaled by e / (u - 1), the rounding of u = 1 + e undone (e itself
    # where u rounds to 1)
    b_one = b_u == 1.0
    b_log1p = tl.where(b_one, b_e, tl.log(b_u) * (b_e / tl.where(b_one, 1.0, b_u - 1.0)))
    b_sp = tl.where(b_x > THRESHOLD, b_x, b_log1p)
    b_g = -tl.exp(b_alog)[None, :] * b_sp
    b_eb = tl.exp(-tl.abs(b_b))  # sigmoid from exp(-|b|) <= 1: nothing overflows
    b_beta = tl.where(b_b >= 0, 1.0 / (1.0 + b_eb), b_eb / (1.0 + b_eb))
    out = rows * HV + o_h[None, :]  # g and beta are contiguous [T, Hv]
    tl.store(g + out, b_g, mask=mask)
    tl.store(beta + out, b_beta, mask=mask)


def triton_gdn_gating(a_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
                      b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton wrapper; same contract as ``kernels.gdn_gating.gdn_gating``."""
    t, hv = check_gdn_gating_inputs(a_log, a, dt_bias, b)
    a, b = with_unit_stride(a), with_unit_stride(b)
    a_log, dt_bias = a_log.contiguous(), dt_bias.contiguous()
    assert unit_stride(a) and unit_stride(b), "gdn_gating: a and b need a unit stride on their last dim"
    g = torch.empty(t, hv, dtype=torch.float32, device=a.device)
    beta = torch.empty(t, hv, dtype=torch.float32, device=a.device)
    if t == 0:
        return g, beta
    gdn_gating_kernel[(triton.cdiv(t, BT),)](
        a_log, a, dt_bias, b, g, beta, t, a.stride(0), b.stride(0),
        HV=hv, BHV=triton.next_power_of_2(hv), BT=BT, THRESHOLD=SOFTPLUS_THRESHOLD,
    )
    return g, beta
