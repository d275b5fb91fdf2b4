"""Triton kernels for the chunked (WY/UT) gated delta rule, for prefill (algebra in README.md).

Two launches:

1. ``chunk_gated_delta_rule_prepare_kernel``, one program per (row, chunk, value head), all
   chunks in parallel: the cumulative log decay ``c``, the strictly lower-triangular ``A``,
   ``T = (I + A)^-1`` by forward substitution, and ``w = T diag(beta gamma) K``,
   ``u = T diag(beta) V``, written to float32 scratch buffers.
2. ``chunk_gated_delta_rule_fwd_kernel``, one program per (row, value head, block of value
   columns): visits the row's chunks in order with the state block ``[BK, BV]`` in registers,
   ``v' = u - w S``, ``o = (q gamma) S + (q k^T * decay) v'``, then the state update.

Every program reads only its own row's tokens, so a row's result does not depend on its
neighbours. The products use ``tf32x3`` on NVIDIA tensor cores (close to full fp32), because
the chunked prefill hands its state to the recurrent decode and the two must agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.constants import PAD_SLOT_ID
from kernels.gated_delta_rule.triton_recurrent import _check_common


@triton.jit
def _load_qk_rows(x, o_tok, m_t, i_hk, stride_t, stride_h, o_k, mask_k, USE_QK_L2NORM: tl.constexpr):
    """``[BT, BK]`` float32 block of q or k for the chunk's tokens, L2-normalised per token."""
    b_x = tl.load(x + o_tok[:, None] * stride_t + i_hk * stride_h + o_k[None, :],
                  mask=m_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
    if USE_QK_L2NORM:
        b_x = b_x / tl.sqrt(tl.sum(b_x * b_x, 1) + 1e-6)[:, None]
    return b_x


@triton.jit(do_not_specialize=["max_chunks"])
def chunk_gated_delta_rule_prepare_kernel(
    k, v, g, beta, w_buf, u_buf, c_buf, cu_seqlens, max_chunks,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_g_t, stride_b_t,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_nc, i_hv = tl.program_id(0), tl.program_id(1)
    i_n, i_c = i_nc // max_chunks, i_nc % max_chunks
    i_hk = i_hv // (HV // HK)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    if bos + i_c * BT >= eos:
        return
    o_t = tl.arange(0, BT)
    o_tok = bos + i_c * BT + o_t
    m_t = o_tok < eos
    o_k = tl.arange(0, BK)
    mask_k = o_k < DK
    m_valid = m_t[:, None] & m_t[None, :]
    m_strict = (o_t[:, None] > o_t[None, :]) & m_valid

    b_k = _load_qk_rows(k, o_tok, m_t, i_hk, stride_k_t, stride_k_h, o_k, mask_k, USE_QK_L2NORM)
    b_g = tl.load(g + o_tok * stride_g_t + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + o_tok * stride_b_t + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_c = tl.cumsum(b_g, 0)
    tl.store(c_buf + o_tok * HV + i_hv, b_c, mask=m_t)

    # L = -A, strictly lower: A[i, j] = beta_i (k_i . k_j) exp(c_i - c_j) for j < i.
    b_kb = b_k * b_beta[:, None]
    b_decay = tl.exp(tl.where(m_strict, b_c[:, None] - b_c[None, :], 0.0))
    b_l = tl.dot(b_kb, tl.trans(b_k), input_precision=DOT_PRECISION)
    b_l = -tl.where(m_strict, b_l * b_decay, 0.0)
    # Row i of T' = (I + A)^-1 - I is L[i] + sum_{j<i} L[i, j] T'[j]; rows >= i still hold L,
    # but L[i, j] = 0 for j >= i, so they do not contribute.
    for i in range(1, BT):
        m_row = o_t == i
        b_row = tl.sum(tl.where(m_row[:, None], b_l, 0.0), 0)
        b_row = b_row + tl.sum(b_row[:, None] * b_l, 0)
        b_l = tl.where(m_row[:, None], b_row[None, :], b_l)
    b_tinv = b_l + tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)

    b_w = tl.dot(b_tinv, b_kb * tl.exp(b_c)[:, None], input_precision=DOT_PRECISION)
    tl.store(w_buf + o_tok[:, None] * HV * DK + i_hv * DK + o_k[None, :], b_w,
             mask=m_t[:, None] & mask_k[None, :])
    for i_v in range(tl.cdiv(DV, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < DV)[None, :]
        p_v = v + o_tok[:, None] * stride_v_t + i_hv * stride_v_h + o_v[None, :]
        b_v = tl.load(p_v, mask=m_tv, other=0.0)
        b_u = tl.dot(b_tinv, b_v.to(tl.float32) * b_beta[:, None], input_precision=DOT_PRECISION)
        tl.store(u_buf + o_tok[:, None] * HV * DV + i_hv * DV + o_v[None, :], b_u, mask=m_tv)


@triton.jit
def chunk_gated_delta_rule_fwd_kernel(
    q, k, o, w_buf, u_buf, c_buf, ssm_state, cu_seqlens, state_indices, has_initial_state, scale,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PAD: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_hk = i_hv // (HV // HK)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    i_slot = tl.load(state_indices + i_n).to(tl.int64)
    if (eos <= bos) | (i_slot == PAD):
        return

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < DK
    mask_v = o_v < DV
    mask_h = mask_k[:, None] & mask_v[None, :]
    p_h = ssm_state + i_slot * HV * DK * DV + i_hv * DK * DV + o_k[:, None] * DV + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if tl.load(has_initial_state + i_n):
        b_h = tl.load(p_h, mask=mask_h, other=0.0)

    for i_c in range(tl.cdiv(eos - bos, BT)):
        o_tok = bos + i_c * BT + o_t
        m_t = o_tok < eos
        m_tk = m_t[:, None] & mask_k[None, :]
        m_tv = m_t[:, None] & mask_v[None, :]
        b_c = tl.load(c_buf + o_tok * HV + i_hv, mask=m_t, other=0.0)
        b_w = tl.load(w_buf + o_tok[:, None] * HV * DK + i_hv * DK + o_k[None, :], mask=m_tk, other=0.0)
        b_u = tl.load(u_buf + o_tok[:, None] * HV * DV + i_hv * DV + o_v[None, :], mask=m_tv, other=0.0)
        b_vnew = b_u - tl.dot(b_w, b_h, input_precision=DOT_PRECISION)               # [BT, BV]

        b_q = _load_qk_rows(q, o_tok, m_t, i_hk, stride_q_t, stride_q_h, o_k, mask_k, USE_QK_L2NORM) * scale
        b_k = _load_qk_rows(k, o_tok, m_t, i_hk, stride_k_t, stride_k_h, o_k, mask_k, USE_QK_L2NORM)
        m_causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
        b_decay = tl.where(m_causal, tl.exp(tl.where(m_causal, b_c[:, None] - b_c[None, :], 0.0)), 0.0)
        b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * b_decay
        b_o = tl.dot(b_q * tl.exp(b_c)[:, None], b_h, input_precision=DOT_PRECISION)
        b_o = b_o + tl.dot(b_qk, b_vnew, input_precision=DOT_PRECISION)
        p_o = o + o_tok[:, None] * HV * DV + i_hv * DV + o_v[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_tv)

        # Decay to the chunk's last valid token; padded tokens have k = 0 and v' = 0.
        n_valid = tl.minimum(eos - (bos + i_c * BT), BT)
        b_c_last = tl.sum(tl.where(o_t == n_valid - 1, b_c, 0.0), 0)
        b_kd = b_k * tl.exp(tl.where(m_t, b_c_last - b_c, 0.0))[:, None]
        b_h = b_h * tl.exp(b_c_last) + tl.dot(tl.trans(b_kd), b_vnew, input_precision=DOT_PRECISION)

    tl.store(p_h, b_h, mask=mask_h)


def triton_chunk_gated_delta_rule(
    q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, has_initial_state, *,
    scale=None, use_qk_l2norm=True, chunk_size=64,
):
    """Triton wrapper; same contract as ``kernels.gated_delta_rule.chunk_gated_delta_rule``."""
    num_tokens, hk, hv, dk, dv, n = _check_common(q, k, v, g, beta, ssm_state, cu_seqlens)
    assert state_indices.shape == (n,) and state_indices.dtype == torch.int32, "state_indices: int32 [N]"
    assert state_indices.is_contiguous()
    if has_initial_state is None:
        has_initial_state = torch.ones(n, dtype=torch.bool, device=q.device)
    assert has_initial_state.shape == (n,) and has_initial_state.dtype == torch.bool
    assert chunk_size >= 16 and chunk_size & (chunk_size - 1) == 0, "chunk_size: a power of two >= 16"
    scale = dk ** -0.5 if scale is None else float(scale)
    o = torch.zeros(num_tokens, hv, dv, dtype=v.dtype, device=v.device)
    if num_tokens == 0 or n == 0:
        return o
    w_buf = torch.empty(num_tokens, hv, dk, dtype=torch.float32, device=q.device)
    u_buf = torch.empty(num_tokens, hv, dv, dtype=torch.float32, device=q.device)
    c_buf = torch.empty(num_tokens, hv, dtype=torch.float32, device=q.device)
    # tl.dot needs every block dimension >= 16. No row has more chunks than the whole batch, so
    # the prepare grid needs no host read of cu_seqlens (programs past a row's end exit).
    bk = max(16, triton.next_power_of_2(dk))
    bv = max(16, min(triton.next_power_of_2(dv), 32))
    max_chunks = triton.cdiv(num_tokens, chunk_size)
    common = {"HK": hk, "HV": hv, "DK": dk, "DV": dv, "BT": chunk_size, "BK": bk, "BV": bv,
              "USE_QK_L2NORM": use_qk_l2norm, "DOT_PRECISION": "tf32x3", "num_warps": 8 if bk >= 64 else 4}
    chunk_gated_delta_rule_prepare_kernel[(n * max_chunks, hv)](
        k, v, g, beta, w_buf, u_buf, c_buf, cu_seqlens, max_chunks,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        **common,
    )
    chunk_gated_delta_rule_fwd_kernel[(triton.cdiv(dv, bv), n * hv)](
        q, k, o, w_buf, u_buf, c_buf, ssm_state, cu_seqlens, state_indices, has_initial_state, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        PAD=PAD_SLOT_ID, **common,
    )
    return o
