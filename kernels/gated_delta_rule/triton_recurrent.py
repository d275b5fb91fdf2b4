"""Triton kernel for the token-by-token gated delta rule over a pooled state (decode / verify).

One program per (row, value head, block of ``BV`` value columns, see ``launch_config``). The
state block ``[BK, BV]`` stays in registers while the program walks the row's tokens in order, so a row's result does not
depend on its neighbours.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.constants import PAD_SLOT_ID


@triton.heuristics({
    "IS_SPEC": lambda args: args["num_accepted_tokens"] is not None,
    "HAS_INIT_FLAGS": lambda args: args["has_initial_state"] is not None,
})
@triton.jit(do_not_specialize=["num_cols"])
def fused_recurrent_gated_delta_rule_fwd_kernel(
    q, k, v, g, beta, o, ssm_state, cu_seqlens, state_indices, num_accepted_tokens, has_initial_state,
    scale, num_cols,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_g_t, stride_b_t, stride_idx_n,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PAD: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, IS_SPEC: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
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
        i_read = tl.load(p_idx + tl.load(num_accepted_tokens + i_n) - 1).to(tl.int64)
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
        b_h = tl.load(ssm_state + i_read * HV * DK * DV + o_h, mask=mask_h, other=0.0)

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
                tl.store(ssm_state + i_write * HV * DK * DV + o_h, b_h, mask=mask_h)
    if not IS_SPEC:
        tl.store(ssm_state + i_read * HV * DK * DV + o_h, b_h, mask=mask_h)


def _check_common(q, k, v, g, beta, ssm_state, cu_seqlens):
    """Shape / dtype / stride assertions shared by the recurrent and chunk wrappers."""
    num_tokens, hk, dk = q.shape
    assert k.shape == q.shape, f"k {tuple(k.shape)} != q {tuple(q.shape)}"
    assert v.dim() == 3 and v.shape[0] == num_tokens, f"v must be [T, Hv, Dv], got {tuple(v.shape)}"
    hv, dv = v.shape[1:]
    assert hv % hk == 0, f"Hv={hv} must be a multiple of Hk={hk}"
    assert g.shape == (num_tokens, hv) and beta.shape == (num_tokens, hv), "g and beta must be [T, Hv]"
    assert g.dtype == torch.float32 and beta.dtype == torch.float32, "g and beta must be float32"
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert x.stride(-1) == 1, f"{name} needs a unit stride on its last dimension"
    assert g.stride(1) == 1 and beta.stride(1) == 1, "g and beta need a unit stride over heads"
    assert ssm_state.dim() == 4 and ssm_state.shape[1:] == (hv, dk, dv), (
        f"ssm_state must be [S, {hv}, {dk}, {dv}], got {tuple(ssm_state.shape)}")
    assert ssm_state.dtype == torch.float32 and ssm_state.is_contiguous(), "ssm_state: contiguous float32"
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1 and cu_seqlens.is_contiguous()
    return num_tokens, hk, hv, dk, dv, cu_seqlens.numel() - 1


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
    num_accepted_tokens=None, has_initial_state=None, scale=None, use_qk_l2norm=True,
):
    """Triton wrapper; same contract as ``kernels.gated_delta_rule.fused_recurrent_gated_delta_rule``."""
    num_tokens, hk, hv, dk, dv, n = _check_common(q, k, v, g, beta, ssm_state, cu_seqlens)
    assert state_indices.dtype == torch.int32, "state_indices must be int32"
    assert state_indices.dim() in (1, 2), "state_indices: [N] or [N, K+1]"
    assert state_indices.shape[0] == n, f"state_indices has {state_indices.shape[0]} rows, cu_seqlens {n}"
    assert state_indices.stride(-1) == 1, "state_indices needs a unit stride on its last dimension"
    if state_indices.dim() == 2:
        assert num_accepted_tokens is not None, "2-D state_indices need num_accepted_tokens"
        assert num_accepted_tokens.shape == (n,) and num_accepted_tokens.dtype == torch.int32
    else:
        assert num_accepted_tokens is None, "num_accepted_tokens needs 2-D state_indices"
    if has_initial_state is not None:
        assert has_initial_state.shape == (n,) and has_initial_state.dtype == torch.bool
    scale = dk ** -0.5 if scale is None else float(scale)
    o = torch.zeros(num_tokens, hv, dv, dtype=v.dtype, device=v.device)
    cfg = launch_config(dk, dv)
    grid = (triton.cdiv(dv, cfg["BV"]), n * hv)
    fused_recurrent_gated_delta_rule_fwd_kernel[grid](
        q, k, v, g, beta, o, ssm_state, cu_seqlens, state_indices, num_accepted_tokens, has_initial_state,
        scale, state_indices.shape[-1] if state_indices.dim() == 2 else 1,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), state_indices.stride(0),
        HK=hk, HV=hv, DK=dk, DV=dv, BK=cfg["BK"], BV=cfg["BV"], PAD=PAD_SLOT_ID, USE_QK_L2NORM=use_qk_l2norm,
        num_warps=cfg["num_warps"],
    )
    return o
