"""Triton kernels for the chunked (WY/UT) gated delta rule, for prefill (algebra in README.md).

Three launches, so that no program holds a whole ``[Dk, Dv]`` state next to whole ``[BT, Dk]``
operands (at Dk = Dv = 128 that does not fit an H100's shared memory):

1. ``chunk_gdn_wy_kernel``, one program per (chunk, value head), all chunks in parallel: the
   chunk-local cumulative log decay ``c``, ``A`` from ``K K^T`` (Dk in tiles of ``BK``),
   ``T = (I + A)^-1`` (16 x 16 diagonal blocks by forward substitution, then a nilpotent series
   for the blocks below), then ``w = T diag(beta gamma) K`` and
   ``u = T diag(beta) V`` tile by tile, and ``1 / |k|`` per token.
2. ``chunk_gdn_state_kernel``, one program per (row, value head, block of ``BV`` value columns), rows x
   heads on grid axis 0 (CUDA takes at most 65535 programs on axes 1 and 2):
   the only sequential part. It walks the row's chunks with its state columns in registers, kept
   as up to four ``[BK, BV]`` tiles (Dk <= 4 * BK), writes the state at each chunk start to
   ``h``, overwrites ``u`` with ``v' = u - w S``, and writes the final state to the pool.
3. ``chunk_gdn_output_kernel``, one program per (chunk, value head, block of value columns), all
   chunks in parallel: ``o = (q gamma) S_chunk + (q k^T * decay) v'``.

Chunks are numbered without reading ``cu_seqlens`` on the host: row i's chunks take the slots
from ``cu[i] // BT + i`` on, which over-counts by at most one slot per row, so ``T // BT + N``
slots cover every chunk, and a program finds its row by comparing its slot with every row's
first slot. Every program reads only its own row's tokens, so a row's result does not depend on
its neighbours.

Products: on the GPU ``q k^T`` and ``k k^T`` take the inputs as they are (16-bit operands are
multiplied exactly into a float32 accumulator); products with float32 operands (``T``, ``S``,
``w``, ``u``, ``v'``) use ``tf32x3``, close to full float32, because the chunked prefill hands its
state to the recurrent decode and the two must agree. Under the interpreter every product is a
float32 one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import as_contiguous, as_index, write_back
from kernels.constants import PAD_SLOT_ID
from kernels.gated_delta_rule.contract import CHUNK_MAX_DK, CHUNK_MAX_SLOTS, CHUNK_SIZES, check_chunk_inputs
from kernels.gated_delta_rule.triton_recurrent import kernel_inputs, kernel_pool

MAX_K_TILES = 4  # the state kernel keeps the state as at most four [BK, BV] tiles
MAX_BK = 64
assert MAX_K_TILES * MAX_BK == CHUNK_MAX_DK, "the contract's Dk limit is the state kernel's"


@triton.jit
def _row_of_slot(cu_seqlens, i_s, N, BT: tl.constexpr, BN: tl.constexpr):
    """(row, chunk within the row) of chunk slot ``i_s``; row i's slots start at cu[i] // BT + i."""
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    b_first = tl.load(cu_seqlens + o_n, mask=m_n, other=0) // BT + o_n
    i_n = tl.sum(tl.where(m_n & (b_first <= i_s), 1, 0), 0) - 1
    i_c = i_s - (tl.load(cu_seqlens + i_n) // BT + i_n)
    return i_n, i_c


@triton.jit
def _load_tile(x, o_tok, m_t, i_h, stride_t, stride_h, o_d, m_d, FP32: tl.constexpr):
    """``[BT, BD]`` tile of a token-major ``[T, H, D]`` tensor; float32 when ``FP32``."""
    b_x = tl.load(x + o_tok[:, None] * stride_t + i_h * stride_h + o_d[None, :],
                  mask=m_t[:, None] & m_d[None, :], other=0.0)
    if FP32:
        b_x = b_x.to(tl.float32)
    return b_x


@triton.jit(do_not_specialize=["N"])
def chunk_gdn_wy_kernel(
    k,
    v,
    g,
    beta,
    w_buf,
    u_buf,
    c_buf,
    rk_buf,
    cu_seqlens,
    state_indices,
    N,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_g_t,
    stride_b_t,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    NK: tl.constexpr,
    BV: tl.constexpr,
    BN: tl.constexpr,
    PAD: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    LOWP_QK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_s, i_hv = tl.program_id(0), tl.program_id(1)
    i_hk = i_hv // (HV // HK)
    i_n, i_c = _row_of_slot(cu_seqlens, i_s, N, BT, BN)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    if (bos + i_c * BT >= eos) | (tl.load(state_indices + i_n) == PAD):
        return
    o_t = tl.arange(0, BT)
    o_tok = bos + i_c * BT + o_t
    m_t = o_tok < eos
    m_strict = (o_t[:, None] > o_t[None, :]) & m_t[:, None] & m_t[None, :]

    b_g = tl.load(g + o_tok * stride_g_t + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + o_tok * stride_b_t + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_c = tl.cumsum(b_g, 0)
    tl.store(c_buf + o_tok * HV + i_hv, b_c, mask=m_t)

    # K K^T and |k|^2 over Dk tiles; the L2 norm is applied to the product afterwards.
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    b_ss = tl.zeros([BT], dtype=tl.float32)
    for i_k in tl.static_range(NK):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = _load_tile(k, o_tok, m_t, i_hk, stride_k_t, stride_k_h, o_k, o_k < DK, not LOWP_QK)
        b_kk += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION)
        b_kf = b_k.to(tl.float32)
        b_ss += tl.sum(b_kf * b_kf, 1)
    b_rk = tl.full([BT], 1.0, tl.float32)
    if USE_QK_L2NORM:
        b_rk = 1.0 / tl.sqrt(b_ss + 1e-6)
    tl.store(rk_buf + o_tok * HV + i_hv, b_rk, mask=m_t)

    # L = -A, strictly lower: A[i, j] = beta_i (k_i . k_j) exp(c_i - c_j) for j < i.
    b_decay = tl.exp(tl.where(m_strict, b_c[:, None] - b_c[None, :], 0.0))
    b_l = -tl.where(m_strict, b_kk * (b_beta * b_rk)[:, None] * b_rk[None, :] * b_decay, 0.0)
    # T = (I + A)^-1 in two steps. First D = (I + A_d)^-1 for the diagonal 16 x 16 blocks A_d, all blocks
    # at once by forward substitution: row i of D - I is L[i] + L[i] (D - I), where L[i, j] = 0 unless
    # j < i in i's block, so only rows already done contribute (15 steps instead of BT - 1).
    o_blk = o_t // 16
    m_same = o_blk[:, None] == o_blk[None, :]
    b_eye = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    b_d = tl.where(m_same, b_l, 0.0)
    for i in range(1, 16):
        m_rows = (o_t % 16) == i
        b_rows = tl.where(m_rows[:, None], b_d, 0.0)
        b_d = tl.where(m_rows[:, None], b_rows + tl.dot(b_rows, b_d, input_precision=DOT_PRECISION), b_d)
    b_tinv = b_d + b_eye
    if BT > 16:
        # Then with the blocks below the diagonal, L_o: I + A = (I + A_d)(I - P) with P = D L_o strictly
        # block-lower, so P^(BT/16) = 0 and T = (I + P + P^2 + ...) D.
        b_p = tl.dot(b_tinv, tl.where(m_same, 0.0, b_l), input_precision=DOT_PRECISION)
        b_sum = b_eye + b_p
        b_pk = b_p
        for _ in tl.static_range(BT // 16 - 2):
            b_pk = tl.dot(b_pk, b_p, input_precision=DOT_PRECISION)
            b_sum += b_pk
        b_tinv = tl.dot(b_sum, b_tinv, input_precision=DOT_PRECISION)

    b_wk = b_beta * tl.exp(b_c) * b_rk  # w = T diag(beta gamma) K_hat
    for i_k in tl.static_range(NK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < DK
        b_k = _load_tile(k, o_tok, m_t, i_hk, stride_k_t, stride_k_h, o_k, m_k, True)
        b_w = tl.dot(b_tinv, b_k * b_wk[:, None], input_precision=DOT_PRECISION)
        tl.store(w_buf + o_tok[:, None] * HV * DK + i_hv * DK + o_k[None, :], b_w,
                 mask=m_t[:, None] & m_k[None, :])
    for i_v in tl.static_range((DV + BV - 1) // BV):  # constexpr arithmetic: a static trip count
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < DV
        b_v = _load_tile(v, o_tok, m_t, i_hv, stride_v_t, stride_v_h, o_v, m_v, True)
        b_u = tl.dot(b_tinv, b_v * b_beta[:, None], input_precision=DOT_PRECISION)
        tl.store(u_buf + o_tok[:, None] * HV * DV + i_hv * DV + o_v[None, :], b_u,
                 mask=m_t[:, None] & m_v[None, :])


@triton.jit
def _state_tile_step(b_h, w_buf, k, o_tok, m_t, i_hk, i_hv, stride_k_t, stride_k_h, b_kdecay,
                     i_k: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """One ``[BK, BV]`` state tile: ``v' -= w[:, tile] S[tile]`` and the tile's decayed update."""
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < DK
    b_w = tl.load(w_buf + o_tok[:, None] * HV * DK + i_hv * DK + o_k[None, :],
                  mask=m_t[:, None] & m_k[None, :], other=0.0)
    b_k = _load_tile(k, o_tok, m_t, i_hk, stride_k_t, stride_k_h, o_k, m_k, True)
    return tl.dot(b_w, b_h, input_precision=DOT_PRECISION), b_k * b_kdecay[:, None]


@triton.jit
def _store_state_tile(p, b_h, i_k: tl.constexpr, o_v, m_v, DK: tl.constexpr, DV: tl.constexpr,
                      BK: tl.constexpr):
    o_k = i_k * BK + tl.arange(0, BK)
    tl.store(p + o_k[:, None] * DV + o_v[None, :], b_h.to(p.dtype.element_ty),
             mask=(o_k < DK)[:, None] & m_v[None, :])


@triton.jit
def _load_state_tile(p, i_k: tl.constexpr, o_v, m_v, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr):
    o_k = i_k * BK + tl.arange(0, BK)
    b_h = tl.load(p + o_k[:, None] * DV + o_v[None, :], mask=(o_k < DK)[:, None] & m_v[None, :], other=0.0)
    return b_h.to(tl.float32)


@triton.jit
def chunk_gdn_state_kernel(
    k,
    w_buf,
    u_buf,
    c_buf,
    rk_buf,
    h_buf,
    ssm_state,
    cu_seqlens,
    state_indices,
    has_initial_state,
    stride_k_t,
    stride_k_h,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    NK: tl.constexpr,
    BV: tl.constexpr,
    PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)  # rows x heads on axis 0: past 65535 in a wide batch
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_hk = i_hv // (HV // HK)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    i_slot = tl.load(state_indices + i_n).to(tl.int64)
    if (eos <= bos) | (i_slot == PAD):
        return
    first_chunk = bos // BT + i_n
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    p_pool = ssm_state + i_slot * HV * DK * DV + i_hv * DK * DV

    b_h0 = tl.zeros([BK, BV], dtype=tl.float32)
    b_h1 = tl.zeros([BK, BV], dtype=tl.float32)
    b_h2 = tl.zeros([BK, BV], dtype=tl.float32)
    b_h3 = tl.zeros([BK, BV], dtype=tl.float32)
    if tl.load(has_initial_state + i_n):
        b_h0 = _load_state_tile(p_pool, 0, o_v, m_v, DK, DV, BK)
        if NK > 1:
            b_h1 = _load_state_tile(p_pool, 1, o_v, m_v, DK, DV, BK)
        if NK > 2:
            b_h2 = _load_state_tile(p_pool, 2, o_v, m_v, DK, DV, BK)
        if NK > 3:
            b_h3 = _load_state_tile(p_pool, 3, o_v, m_v, DK, DV, BK)

    for i_c in range(tl.cdiv(eos - bos, BT)):
        o_tok = bos + i_c * BT + o_t
        m_t = o_tok < eos
        # The state at the chunk's start, for the output kernel.
        p_h = h_buf + (first_chunk + i_c) * HV * DK * DV + i_hv * DK * DV
        _store_state_tile(p_h, b_h0, 0, o_v, m_v, DK, DV, BK)
        if NK > 1:
            _store_state_tile(p_h, b_h1, 1, o_v, m_v, DK, DV, BK)
        if NK > 2:
            _store_state_tile(p_h, b_h2, 2, o_v, m_v, DK, DV, BK)
        if NK > 3:
            _store_state_tile(p_h, b_h3, 3, o_v, m_v, DK, DV, BK)

        # Decay to the chunk's last valid token; padded tokens have k = 0 and v' = 0.
        b_c = tl.load(c_buf + o_tok * HV + i_hv, mask=m_t, other=0.0)
        n_valid = tl.minimum(eos - (bos + i_c * BT), BT)
        b_c_last = tl.sum(tl.where(o_t == n_valid - 1, b_c, 0.0), 0)
        b_rk = tl.load(rk_buf + o_tok * HV + i_hv, mask=m_t, other=0.0)
        b_kdecay = tl.where(m_t, tl.exp(b_c_last - b_c) * b_rk, 0.0)

        p_u = u_buf + o_tok[:, None] * HV * DV + i_hv * DV + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_wh, b_kd0 = _state_tile_step(b_h0, w_buf, k, o_tok, m_t, i_hk, i_hv, stride_k_t, stride_k_h,
                                       b_kdecay, 0, HV, DK, BK, DOT_PRECISION)
        b_vnew = tl.load(p_u, mask=m_tv, other=0.0) - b_wh
        if NK > 1:
            b_wh, b_kd1 = _state_tile_step(b_h1, w_buf, k, o_tok, m_t, i_hk, i_hv, stride_k_t, stride_k_h,
                                           b_kdecay, 1, HV, DK, BK, DOT_PRECISION)
            b_vnew -= b_wh
        if NK > 2:
            b_wh, b_kd2 = _state_tile_step(b_h2, w_buf, k, o_tok, m_t, i_hk, i_hv, stride_k_t, stride_k_h,
                                           b_kdecay, 2, HV, DK, BK, DOT_PRECISION)
            b_vnew -= b_wh
        if NK > 3:
            b_wh, b_kd3 = _state_tile_step(b_h3, w_buf, k, o_tok, m_t, i_hk, i_hv, stride_k_t, stride_k_h,
                                           b_kdecay, 3, HV, DK, BK, DOT_PRECISION)
            b_vnew -= b_wh
        tl.store(p_u, b_vnew, mask=m_tv)  # u becomes v' in place: only this program reads it later

        b_gamma_last = tl.exp(b_c_last)
        b_h0 = b_h0 * b_gamma_last + tl.dot(tl.trans(b_kd0), b_vnew, input_precision=DOT_PRECISION)
        if NK > 1:
            b_h1 = b_h1 * b_gamma_last + tl.dot(tl.trans(b_kd1), b_vnew, input_precision=DOT_PRECISION)
        if NK > 2:
            b_h2 = b_h2 * b_gamma_last + tl.dot(tl.trans(b_kd2), b_vnew, input_precision=DOT_PRECISION)
        if NK > 3:
            b_h3 = b_h3 * b_gamma_last + tl.dot(tl.trans(b_kd3), b_vnew, input_precision=DOT_PRECISION)

    _store_state_tile(p_pool, b_h0, 0, o_v, m_v, DK, DV, BK)
    if NK > 1:
        _store_state_tile(p_pool, b_h1, 1, o_v, m_v, DK, DV, BK)
    if NK > 2:
        _store_state_tile(p_pool, b_h2, 2, o_v, m_v, DK, DV, BK)
    if NK > 3:
        _store_state_tile(p_pool, b_h3, 3, o_v, m_v, DK, DV, BK)


@triton.jit(do_not_specialize=["N", "scale"])
def chunk_gdn_output_kernel(
    q,
    k,
    o,
    vnew_buf,
    c_buf,
    h_buf,
    cu_seqlens,
    state_indices,
    N,
    scale,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    NK: tl.constexpr,
    BV: tl.constexpr,
    BN: tl.constexpr,
    PAD: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    LOWP_QK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_v, i_s, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_hv // (HV // HK)
    i_n, i_c = _row_of_slot(cu_seqlens, i_s, N, BT, BN)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    if (bos + i_c * BT >= eos) | (tl.load(state_indices + i_n) == PAD):
        return
    o_t = tl.arange(0, BT)
    o_tok = bos + i_c * BT + o_t
    m_t = o_tok < eos
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    p_h = h_buf + i_s.to(tl.int64) * HV * DK * DV + i_hv * DK * DV

    # q S and q k^T over Dk tiles, with the squared norms; the L2 norms are applied afterwards.
    b_qh = tl.zeros([BT, BV], dtype=tl.float32)
    b_qk = tl.zeros([BT, BT], dtype=tl.float32)
    b_sq = tl.zeros([BT], dtype=tl.float32)
    b_sk = tl.zeros([BT], dtype=tl.float32)
    for i_k in tl.static_range(NK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < DK
        b_q = _load_tile(q, o_tok, m_t, i_hk, stride_q_t, stride_q_h, o_k, m_k, not LOWP_QK)
        b_k = _load_tile(k, o_tok, m_t, i_hk, stride_k_t, stride_k_h, o_k, m_k, not LOWP_QK)
        b_qk += tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)
        b_qf, b_kf = b_q.to(tl.float32), b_k.to(tl.float32)
        b_sq += tl.sum(b_qf * b_qf, 1)
        b_sk += tl.sum(b_kf * b_kf, 1)
        b_h = tl.load(p_h + o_k[:, None] * DV + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_qh += tl.dot(b_qf, b_h, input_precision=DOT_PRECISION)
    b_rq = tl.full([BT], 1.0, tl.float32)
    b_rk = tl.full([BT], 1.0, tl.float32)
    if USE_QK_L2NORM:
        b_rq = 1.0 / tl.sqrt(b_sq + 1e-6)
        b_rk = 1.0 / tl.sqrt(b_sk + 1e-6)

    b_c = tl.load(c_buf + o_tok * HV + i_hv, mask=m_t, other=0.0)
    b_qs = b_rq * scale
    m_causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_decay = tl.exp(tl.where(m_causal, b_c[:, None] - b_c[None, :], 0.0))
    b_a = tl.where(m_causal, b_qk * b_qs[:, None] * b_rk[None, :] * b_decay, 0.0)
    m_tv = m_t[:, None] & m_v[None, :]
    b_vnew = tl.load(vnew_buf + o_tok[:, None] * HV * DV + i_hv * DV + o_v[None, :], mask=m_tv, other=0.0)
    b_o = b_qh * (b_qs * tl.exp(b_c))[:, None] + tl.dot(b_a, b_vnew, input_precision=DOT_PRECISION)
    tl.store(o + o_tok[:, None] * HV * DV + i_hv * DV + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


def launch_config(dk: int, dv: int, chunk_size: int) -> dict:
    """Block sizes and warps of the three launches (shared with kernels/gated_delta_rule/compile_cases.py)."""
    bk = min(MAX_BK, max(16, triton.next_power_of_2(dk)))  # tl.dot needs every block dimension >= 16
    assert triton.cdiv(dk, bk) <= MAX_K_TILES, f"Dk={dk}: the chunk kernels take Dk <= {CHUNK_MAX_DK}"
    assert chunk_size in CHUNK_SIZES, f"chunk_size={chunk_size}: the chunk kernels take {CHUNK_SIZES}"
    return {
        "BT": chunk_size, "BK": bk, "NK": triton.cdiv(dk, bk),
        # Eight warps spread the [BT, BT] products and the [Dk, BV] state tiles over more registers; two
        # pipeline stages keep the state kernel at Dk = 256 inside an A100's shared memory; at 64 value
        # columns ptxas gives the output kernel 32 registers and an 8 KiB spill stack on sm_80, at 32 it
        # gets 255 registers and spills under 1 KiB (python -m kernels.compile_check).
        "wy": {"BV": min(64, max(16, triton.next_power_of_2(dv))), "num_warps": 8, "num_stages": 3},
        "state": {"BV": min(32, max(16, triton.next_power_of_2(dv))), "num_warps": 8, "num_stages": 2},
        "output": {"BV": min(32, max(16, triton.next_power_of_2(dv))), "num_warps": 8, "num_stages": 3},
    }


def triton_chunk_gated_delta_rule(
    q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, has_initial_state, *,
    scale=None, use_qk_l2norm=True, chunk_size=64,
):
    """Triton wrapper; same contract as ``kernels.gated_delta_rule.chunk_gated_delta_rule``."""
    num_tokens, hk, hv, dk, dv, n = check_chunk_inputs(
        q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, has_initial_state, scale, use_qk_l2norm,
        chunk_size)
    q, k, v, g, beta, cu_seqlens = kernel_inputs(q, k, v, g, beta, cu_seqlens)
    state_indices = as_index(state_indices)
    assert state_indices.dtype == torch.int32 and state_indices.is_contiguous(), "state_indices: int32"
    if has_initial_state is None:
        has_initial_state = torch.ones(n, dtype=torch.bool, device=q.device)
    has_initial_state = as_contiguous(has_initial_state)
    scale = dk ** -0.5 if scale is None else float(scale)
    o = torch.zeros(num_tokens, hv, dv, dtype=v.dtype, device=v.device)
    if num_tokens == 0 or n == 0:
        return o
    pool = kernel_pool(ssm_state)
    cfg = launch_config(dk, dv, chunk_size)
    num_slots = num_tokens // chunk_size + n  # chunk slots, no host read of cu_seqlens (module docstring)
    assert num_slots <= CHUNK_MAX_SLOTS, f"{num_slots} chunk slots: more than a CUDA grid axis takes"
    dev = q.device
    w_buf = torch.empty(num_tokens, hv, dk, dtype=torch.float32, device=dev)
    u_buf = torch.empty(num_tokens, hv, dv, dtype=torch.float32, device=dev)  # u, then v'
    c_buf = torch.empty(num_tokens, hv, dtype=torch.float32, device=dev)
    rk_buf = torch.empty(num_tokens, hv, dtype=torch.float32, device=dev)
    h_buf = torch.empty(num_slots, hv, dk, dv, dtype=torch.float32, device=dev)
    common = {"HK": hk, "HV": hv, "DK": dk, "DV": dv, "BT": chunk_size, "BK": cfg["BK"], "NK": cfg["NK"],
              "PAD": PAD_SLOT_ID,
              "DOT_PRECISION": "tf32x3"}
    # 16-bit q k^T products straight from the inputs when q and k share a 16-bit dtype; float32 otherwise.
    lowp_qk = q.is_cuda and q.dtype == k.dtype and q.dtype in (torch.bfloat16, torch.float16)
    bn = triton.next_power_of_2(n)
    chunk_gdn_wy_kernel[(num_slots, hv)](
        k, v, g, beta, w_buf, u_buf, c_buf, rk_buf, cu_seqlens, state_indices, n,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        BV=cfg["wy"]["BV"], BN=bn, USE_QK_L2NORM=use_qk_l2norm, LOWP_QK=lowp_qk,
        num_warps=cfg["wy"]["num_warps"], num_stages=cfg["wy"]["num_stages"], **common,
    )
    # rows x heads on axis 0 (2^31 - 1 programs): axes 1 and 2 take 65535, 2048 rows of 32 heads.
    chunk_gdn_state_kernel[(n * hv, triton.cdiv(dv, cfg["state"]["BV"]))](
        k,
        w_buf,
        u_buf,
        c_buf,
        rk_buf,
        h_buf,
        pool,
        cu_seqlens,
        state_indices,
        has_initial_state,
        k.stride(0),
        k.stride(1),
        BV=cfg["state"]["BV"],
        num_warps=cfg["state"]["num_warps"],
        num_stages=cfg["state"]["num_stages"],
        **common,
    )
    chunk_gdn_output_kernel[(triton.cdiv(dv, cfg["output"]["BV"]), num_slots, hv)](
        q, k, o, u_buf, c_buf, h_buf, cu_seqlens, state_indices, n, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        BV=cfg["output"]["BV"], BN=bn, USE_QK_L2NORM=use_qk_l2norm, LOWP_QK=lowp_qk,
        num_warps=cfg["output"]["num_warps"], num_stages=cfg["output"]["num_stages"], **common,
    )
    write_back(ssm_state, pool)
    return o
