"""Triton kernel for the token-by-token gated delta rule over a pooled state (decode / verify).

One program per (row, value head, block of ``BV`` value columns, see ``launch_config``), rows x heads on
grid axis 0 (CUDA takes at most 65535 programs on axes 1 and 2). The
state block ``[BK, BV]`` stays in registers while the program walks the row's tokens in order, so a row's
result does not depend on its neighbours.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import FLOATS, as_contiguous, as_index, unit_stride, with_unit_stride, write_back
from kernels.constants import PAD_SLOT_ID
from kernels.gated_delta_rule.contract import check_recurrent_inputs


@triton.heuristics({
    "IS_SPEC": lambda args: args["num_valid"] is not None,
    "HAS_INIT_FLAGS": lambda args: args["has_initial_state"] is not None,
})
@triton.jit(do_not_specialize=["num_cols"])
def fused_recurrent_gated_delta_rule_fwd_kernel(
    q, k, v, g, beta, o, ssm_state, cu_seqlens, state_indices, num_valid, has_initial_state,
    scale, num_cols,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_g_t, stride_b_t, stride_idx_n,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PAD: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, IS_SPEC: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # rows x heads on axis 0: past 65535 in a decode batch
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_hk = i_hv // (HV // HK)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    if eos <= bos:
        return
    p_idx = state_indices + i_n * stride_idx_n
    if IS_SPEC:
        # Padding rows have PAD in column 0; only then is the accepted count meaningful.
        if tl.load(p_idx) == PAD:
            return
        i_read = tl.load(p_idx + tl.load(num_valid + i_n) - 1).to(tl.int64)
    else:
        i_read = tl.load(p_idx).to(tl.int64)
    if i_read == PAD:
        return

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < DK
    mask_v = o_v < DV
    mask_h = mask_k[:, None] & mask_v[None, :]
    o_h = i_hv * DK * DV + o_k[:, None] * DV + o_v[None, :]      # offsets inside one pool slot

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    use_init = True
    if HAS_INIT_FLAGS:
        use_init = tl.load(has_initial_state + i_n) != 0
    if use_init:
        b_h = tl.load(ssm_state + i_read * HV * DK * DV + o_h, mask=mask_h, other=0.0).to(tl.float32)

    for i_t in range(eos - bos):
        t = bos + i_t
        b_q = tl.load(q + t * stride_q_t + i_hk * stride_q_h + o_k, mask=mask_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + t * stride_k_t + i_hk * stride_k_h + o_k, mask=mask_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + t * stride_v_t + i_hv * stride_v_h + o_v, mask=mask_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + t * stride_g_t + i_hv).to(tl.float32)
        b_beta = tl.load(beta + t * stride_b_t + i_hv).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale
        b_h = b_h * tl.exp(b_g)
        b_delta = (b_v - tl.sum(b_k[:, None] * b_h, 0)) * b_beta
        b_h = b_h + b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_q[:, None] * b_h, 0)
        tl.store(o + t * HV * DV + i_hv * DV + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
        if IS_SPEC:
            # The state after token i_t goes to column i_t (PAD columns are not written).
            i_write = tl.load(p_idx + i_t, mask=i_t < num_cols, other=PAD).to(tl.int64)
            if i_write != PAD:
                p_write = ssm_state + i_write * HV * DK * DV + o_h
                tl.store(p_write, b_h.to(ssm_state.dtype.element_ty), mask=mask_h)
    if not IS_SPEC:
        tl.store(ssm_state + i_read * HV * DK * DV + o_h, b_h.to(ssm_state.dtype.element_ty), mask=mask_h)


def kernel_inputs(q, k, v, g, beta, cu_seqlens):
    """The inputs in the form the GDN kernels read, converted only where the caller's are not in it:
    q, k, v, g, beta with a unit stride on their last dimension, cu_seqlens int32 contiguous."""
    q, k, v, g, beta = (with_unit_stride(x) for x in (q, k, v, g, beta))
    cu_seqlens = as_index(cu_seqlens)
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        assert unit_stride(x), f"{name} needs a unit stride on its last dimension"
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous(), "cu_seqlens: contiguous int32"
    return q, k, v, g, beta, cu_seqlens


def kernel_pool(ssm_state: torch.Tensor) -> torch.Tensor:
    """The state pool the kernels address as ``slot * Hv * Dk * Dv``: ``ssm_state`` itself when contiguous,
    else a contiguous copy (written back after the launch). Any float dtype: read and written through
    float32 inside the kernels."""
    pool = as_contiguous(ssm_state)
    assert pool.is_contiguous() and pool.dtype in FLOATS, "ssm_state: a contiguous float pool"
    return pool


def launch_config(dk: int, dv: int) -> dict:
    """Block sizes and warps (shared with kernels/gated_delta_rule/compile_cases.py).

    A verify step has few tokens per row, so the work is spread over many small programs: 16
    value columns of the ``[Dk, 16]`` state each (32 float32 registers per thread at Dk = 128 with
    two warps) rather than a few programs holding wide state blocks.
    """
    bk = triton.next_power_of_2(dk)
    return {"BK": bk, "BV": min(triton.next_power_of_2(dv), 16), "num_warps": 2 if bk >= 64 else 1}


def triton_recurrent_gated_delta_rule(
    q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, *,
    num_valid=None, has_initial_state=None, scale=None, use_qk_l2norm=True,
):
    """Triton wrapper; same contract as ``kernels.gated_delta_rule.fused_recurrent_gated_delta_rule``."""
    num_tokens, hk, hv, dk, dv, n = check_recurrent_inputs(
        q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, num_valid, has_initial_state, scale,
        use_qk_l2norm)
    q, k, v, g, beta, cu_seqlens = kernel_inputs(q, k, v, g, beta, cu_seqlens)
    state_indices, num_valid = as_index(state_indices), as_index(num_valid)
    has_initial_state = as_contiguous(has_initial_state)
    assert state_indices.dtype == torch.int32 and unit_stride(state_indices), "state_indices: int32 rows"
    assert num_valid is None or num_valid.dtype == torch.int32
    scale = dk ** -0.5 if scale is None else float(scale)
    o = torch.zeros(num_tokens, hv, dv, dtype=v.dtype, device=v.device)
    if num_tokens == 0 or n == 0:
        return o
    pool = kernel_pool(ssm_state)
    cfg = launch_config(dk, dv)
    grid = (n * hv, triton.cdiv(dv, cfg["BV"]))  # axis 0 takes 2^31 - 1 programs, axes 1 and 2 65535
    fused_recurrent_gated_delta_rule_fwd_kernel[grid](
        q, k, v, g, beta, o, pool, cu_seqlens, state_indices, num_valid, has_initial_state,
        scale, state_indices.shape[-1] if state_indices.dim() == 2 else 1,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), state_indices.stride(0),
        HK=hk, HV=hv, DK=dk, DV=dv, BK=cfg["BK"], BV=cfg["BV"], PAD=PAD_SLOT_ID, USE_QK_L2NORM=use_qk_l2norm,
        num_warps=cfg["num_warps"],
    )
    write_back(ssm_state, pool)
    return o
