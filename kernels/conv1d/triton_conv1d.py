"""Triton kernel for the causal depthwise conv1d with a pooled conv state (both forms).

One program per (row, block of channels). Column ``m`` of the row's ``full`` sequence
(``concat(window_in, x_row)``) is read from the state at column ``off + m`` when ``m < W-1``
(zeros without an initial state) and from ``x[bos + m - (W-1)]`` otherwise. The program first
computes every output, then reads the new window, then stores it: all reads of the old state
happen before the first write, and no other program touches these channels of this slot.

- prefill form: ``off = 0``; writes ``conv_state[s, :, c] = full[:, L + c]`` for ``c < W-1``;
- update form: ``off = a - 1``; writes ``conv_state[s, :, c] = full[:, 1 + c]`` for ``c < W-2+L``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import as_contiguous, as_index, unit_stride, with_unit_stride, write_back
from kernels.constants import PAD_SLOT_ID
from kernels.conv1d.contract import check_conv1d_fn_inputs, check_conv1d_update_inputs


@triton.heuristics({
    "HAS_INIT_FLAGS": lambda args: args["has_initial_state"] is not None,
    "HAS_ACCEPTED": lambda args: args["num_valid"] is not None,
    "HAS_BIAS": lambda args: args["bias"] is not None,
})
@triton.jit
def causal_conv1d_fwd_kernel(
    x, weight, bias, out, conv_state, cu_seqlens, state_indices, has_initial_state, num_valid,
    C, stride_x_t, stride_o_t, stride_w_c, stride_s_n, stride_s_c, stride_idx_n,
    W: tl.constexpr, BC: tl.constexpr, BS: tl.constexpr, PAD: tl.constexpr,
    IS_UPDATE: tl.constexpr, SILU: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr, HAS_ACCEPTED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    i_n, i_c = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    i_slot = tl.load(state_indices + i_n * stride_idx_n).to(tl.int64)
    if (eos <= bos) | (i_slot == PAD):
        return
    length = eos - bos
    o_c = i_c * BC + tl.arange(0, BC)
    mask_c = o_c < C
    off = 0
    if HAS_ACCEPTED:
        off = tl.load(num_valid + i_n) - 1
    # Columns of `full` read from the state: W-1, or none without an initial state.
    state_cols = W - 1
    if HAS_INIT_FLAGS:
        state_cols = (tl.load(has_initial_state + i_n) != 0).to(tl.int64) * (W - 1)
    p_s = conv_state + i_slot * stride_s_n + o_c * stride_s_c       # column 0 of each channel
    b_bias = tl.zeros([BC], dtype=tl.float32)
    if HAS_BIAS:
        b_bias = tl.load(bias + o_c, mask=mask_c, other=0.0).to(tl.float32)

    for i_t in range(length):
        b_acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(W):
            m = i_t + j + tl.zeros([BC], dtype=tl.int64)            # column of `full`, per channel
            from_state = m < W - 1
            b_s = tl.load(p_s + off + m, mask=mask_c & (m < state_cols), other=0.0)
            b_x = tl.load(x + (bos + m - (W - 1)) * stride_x_t + o_c, mask=mask_c & (m >= W - 1), other=0.0)
            b_f = tl.where(from_state, b_s.to(tl.float32), b_x.to(tl.float32))
            b_w = tl.load(weight + o_c * stride_w_c + j, mask=mask_c, other=0.0).to(tl.float32)
            if HAS_BIAS and j == 0:
                b_acc = b_bias + b_w * b_f  # the sum starts from the bias, as the reference's
            else:
                b_acc += b_w * b_f
        if SILU:
            b_acc = b_acc / (1.0 + tl.exp(-b_acc))
        tl.store(out + (bos + i_t) * stride_o_t + o_c, b_acc.to(out.dtype.element_ty), mask=mask_c)

    # The new window: destination column o_s takes `full` column o_s + shift.
    o_s = tl.arange(0, BS)
    if IS_UPDATE:
        m_s = o_s < W - 2 + length
        o_m = o_s + 1
    else:
        m_s = o_s < W - 1
        o_m = o_s + length
    from_state = o_m < W - 1
    m_write = mask_c[:, None] & m_s[None, :]
    b_old = tl.load(p_s[:, None] + off + o_m[None, :], mask=m_write & (o_m < state_cols)[None, :], other=0.0)
    b_new = tl.load(x + (bos + o_m[None, :] - (W - 1)) * stride_x_t + o_c[:, None],
                    mask=m_write & (o_m >= W - 1)[None, :], other=0.0)
    b_win = tl.where(from_state[None, :], b_old.to(tl.float32), b_new.to(tl.float32))
    tl.store(p_s[:, None] + o_s[None, :], b_win.to(conv_state.dtype.element_ty), mask=m_write)


def _launch(dims, x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state,
            num_valid, activation, is_update):
    """Convert what the kernel cannot take as given (only where needed), launch, write the state back."""
    num_tokens, channels, width, n = dims
    x, weight, bias = with_unit_stride(x), with_unit_stride(weight), as_contiguous(bias)
    cu_seqlens, state_indices, num_valid = (as_index(t) for t in (cu_seqlens, state_indices,
                                                                              num_valid))
    has_initial_state = as_contiguous(has_initial_state)
    assert unit_stride(x) and unit_stride(weight), "x and weight need a unit stride on their last dim"
    assert cu_seqlens.dtype == state_indices.dtype == torch.int32, "cu_seqlens and state_indices: int32"
    assert num_valid is None or num_valid.dtype == torch.int32
    out = torch.zeros(num_tokens, channels, dtype=x.dtype, device=x.device)
    if n == 0 or num_tokens == 0:
        return out
    state = with_unit_stride(conv_state)  # the kernel steps through a window one column at a time
    assert unit_stride(state), "conv_state needs a unit stride on its last dimension"
    bc = min(triton.next_power_of_2(channels), 128)
    grid = (n, triton.cdiv(channels, bc))
    causal_conv1d_fwd_kernel[grid](
        x, weight, bias, out, state, cu_seqlens, state_indices, has_initial_state, num_valid,
        channels, x.stride(0), out.stride(0), weight.stride(0), state.stride(0), state.stride(1),
        state_indices.stride(0),
        W=width, BC=bc, BS=triton.next_power_of_2(state.shape[2]), PAD=PAD_SLOT_ID,
        IS_UPDATE=is_update, SILU=activation == "silu",
    )
    write_back(conv_state, state)
    return out


def triton_causal_conv1d_fn(x, weight, conv_state, cu_seqlens, state_indices, has_initial_state, *,
                            bias=None, activation="silu"):
    """Triton wrapper; same contract as ``kernels.conv1d.causal_conv1d_fn``."""
    dims = check_conv1d_fn_inputs(x, weight, conv_state, cu_seqlens, state_indices, has_initial_state,
                                  activation, bias)
    return _launch(dims, x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state, None,
                   activation, is_update=False)


def triton_causal_conv1d_update(x, weight, conv_state, query_start_loc, state_indices, *,
                                num_valid=None, bias=None, activation="silu"):
    """Triton wrapper; same contract as ``kernels.conv1d.causal_conv1d_update``."""
    dims = check_conv1d_update_inputs(x, weight, conv_state, query_start_loc, state_indices,
                                      num_valid, activation, bias)
    return _launch(dims, x, weight, bias, conv_state, query_start_loc, state_indices, None,
                   num_valid, activation, is_update=True)
