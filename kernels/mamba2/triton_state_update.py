"""Triton kernel for the token-by-token Mamba2 recurrence over a pooled state (decode / verify / prefill).

One program per (row, head, block of ``BP`` of the head's P channels, see ``launch_config``). The
state block ``[BP, N]`` stays in registers while the program walks the row's tokens in order, so a
row's result does not depend on its neighbours.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import FLOATS, as_contiguous, as_index, unit_stride, with_unit_stride, write_back
from kernels.constants import PAD_SLOT_ID
from kernels.mamba2.contract import check_selective_state_update_inputs


@triton.heuristics({
    "IS_SPEC": lambda args: args["num_valid"] is not None,
    "HAS_INIT_FLAGS": lambda args: args["has_initial_state"] is not None,
})
@triton.jit(do_not_specialize=["num_cols"])
def selective_state_update_kernel(
    x, dt, A, B, C, D, y, ssm_state, cu_seqlens, state_indices, num_valid, has_initial_state,
    num_cols,
    stride_x_t, stride_x_h, stride_dt_t, stride_b_t, stride_b_g, stride_c_t, stride_c_g, stride_idx_n,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BP: tl.constexpr, BN: tl.constexpr, PAD: tl.constexpr,
    IS_SPEC: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
):
    i_nh, i_p = tl.program_id(0), tl.program_id(1)  # rows x heads on axis 0: past 65535 in a decode batch
    i_n, i_h = i_nh // H, i_nh % H
    i_g = i_h // (H // G)
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

    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    mask_p = o_p < P
    mask_n = o_n < N
    mask_s = mask_p[:, None] & mask_n[None, :]
    o_s = i_h * P * N + o_p[:, None] * N + o_n[None, :]          # offsets inside one pool slot

    b_s = tl.zeros([BP, BN], dtype=tl.float32)
    use_init = True
    if HAS_INIT_FLAGS:
        use_init = tl.load(has_initial_state + i_n) != 0
    if use_init:
        b_s = tl.load(ssm_state + i_read * H * P * N + o_s, mask=mask_s, other=0.0).to(tl.float32)
    b_a = tl.load(A + i_h).to(tl.float32)
    b_d = tl.load(D + i_h).to(tl.float32)

    for i_t in range(eos - bos):
        t = bos + i_t
        b_x = tl.load(x + t * stride_x_t + i_h * stride_x_h + o_p, mask=mask_p, other=0.0).to(tl.float32)
        b_dt = tl.load(dt + t * stride_dt_t + i_h).to(tl.float32)
        b_b = tl.load(B + t * stride_b_t + i_g * stride_b_g + o_n, mask=mask_n, other=0.0).to(tl.float32)
        b_c = tl.load(C + t * stride_c_t + i_g * stride_c_g + o_n, mask=mask_n, other=0.0).to(tl.float32)
        b_s = b_s * tl.exp(b_dt * b_a)
        b_s = b_s + (b_x * b_dt)[:, None] * b_b[None, :]
        b_y = tl.sum(b_s * b_c[None, :], 1) + b_d * b_x
        tl.store(y + t * H * P + i_h * P + o_p, b_y.to(y.dtype.element_ty), mask=mask_p)
        if IS_SPEC:
            # The state after token i_t goes to column i_t (PAD columns are not written).
            i_write = tl.load(p_idx + i_t, mask=i_t < num_cols, other=PAD).to(tl.int64)
            if i_write != PAD:
                p_write = ssm_state + i_write * H * P * N + o_s
                tl.store(p_write, b_s.to(ssm_state.dtype.element_ty), mask=mask_s)
    if not IS_SPEC:
        tl.store(ssm_state + i_read * H * P * N + o_s, b_s.to(ssm_state.dtype.element_ty), mask=mask_s)


def kernel_inputs(x, dt, A, B, C, D, cu_seqlens):
    """The inputs in the form the Mamba2 kernels read, converted only where the caller's are not in it:
    x, dt, B, C with a unit stride on their last dimension, A and D contiguous, cu_seqlens int32."""
    x, dt, B, C = (with_unit_stride(t) for t in (x, dt, B, C))
    A, D = as_contiguous(A), as_contiguous(D)
    cu_seqlens = as_index(cu_seqlens)
    for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C)):
        assert unit_stride(t), f"{name} needs a unit stride on its last dimension"
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous(), "cu_seqlens: contiguous int32"
    return x, dt, A, B, C, D, cu_seqlens


def kernel_pool(ssm_state: torch.Tensor) -> torch.Tensor:
    """The pool the kernels address as ``slot * H * P * N``: ``ssm_state`` itself when contiguous, else a
    contiguous copy (written back after the launch); read and written through float32."""
    pool = as_contiguous(ssm_state)
    assert pool.is_contiguous() and pool.dtype in FLOATS, "ssm_state: a contiguous float pool"
    return pool


def launch_config(p: int, n: int) -> dict:
    """Block sizes and warps (shared with kernels/mamba2/compile_cases.py): a state block of at most
    2048 float32 values (``[16, 128]`` at the released shapes, 32 registers per thread with two warps),
    so a decode step spreads over ``H * P / 16`` programs per row."""
    bn = triton.next_power_of_2(n)
    bp = max(1, min(triton.next_power_of_2(p), 2048 // bn))
    return {"BP": bp, "BN": bn, "num_warps": 2 if bp * bn >= 1024 else 1}


def triton_selective_state_update(
    x, dt, A, B, C, D, ssm_state, cu_seqlens, state_indices, *,
    num_valid=None, has_initial_state=None,
):
    """Triton wrapper; same contract as ``kernels.mamba2.selective_state_update``."""
    num_tokens, h, p, g, n, rows = check_selective_state_update_inputs(
        x, dt, A, B, C, D, ssm_state, cu_seqlens, state_indices, num_valid, has_initial_state)
    x, dt, A, B, C, D, cu_seqlens = kernel_inputs(x, dt, A, B, C, D, cu_seqlens)
    state_indices, num_valid = as_index(state_indices), as_index(num_valid)
    has_initial_state = as_contiguous(has_initial_state)
    assert state_indices.dtype == torch.int32 and unit_stride(state_indices), "state_indices: int32 rows"
    assert num_valid is None or num_valid.dtype == torch.int32
    y = torch.zeros(num_tokens, h, p, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or rows == 0:
        return y
    pool = kernel_pool(ssm_state)
    cfg = launch_config(p, n)
    grid = (rows * h, triton.cdiv(p, cfg["BP"]))  # axis 0 takes 2^31 - 1 programs, axes 1 and 2 65535
    selective_state_update_kernel[grid](
        x, dt, A, B, C, D, y, pool, cu_seqlens, state_indices, num_valid, has_initial_state,
        state_indices.shape[-1] if state_indices.dim() == 2 else 1,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        state_indices.stride(0),
        H=h, G=g, P=p, N=n, BP=cfg["BP"], BN=cfg["BN"], PAD=PAD_SLOT_ID, num_warps=cfg["num_warps"],
    )
    write_back(ssm_state, pool)
    return y
