"""Chunked GDN, phase 2 of 5: ``(I + A)^-1`` of every chunk (reference: ``naive_phases.chunk_solve``).

One program per (chunk slot, value head), all chunks in parallel, on the chunk's ``BT = 16 NB`` tokens:

1. ``K K^T`` and the squared key norms in one pass over Dk (tiles of 64), then
   ``A[i, j] = beta_i exp(gc_i - gc_j) (k_i . k_j) / (|k_i| |k_j|)`` for ``j < i``;
2. the NB diagonal 16 x 16 blocks, stacked as ``[NB, 16, 16]``, inverted together by forward
   substitution over their 16 rows (elementwise float32, 14 steps whatever NB, fewer in a short
   chunk): ``D = (I + A_diag)^-1``, block diagonal;
3. with ``P = D A_off`` (the blocks below the diagonal, strictly block lower, so ``P^NB = 0``):
   ``(I + A)^-1 = (I + P)^-1 D = (I - P + P^2 - ...) D``, NB products of ``[BT, BT]`` tiles;
4. one store of the ``[BT, BT]`` result (zeros above the diagonal) and of ``rk = 1 / |k|``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gated_delta_rule.triton_chunk_common import KTILE, chunk_bounds, k_tiles, num_slots

BLOCK = 16  # the diagonal blocks' size


@triton.jit
def _invert_diagonal_blocks(b_a, n_rows, NB: tl.constexpr):
    """``(I + A_ii)^-1`` of the NB diagonal blocks of the strictly lower ``[BT, BT]`` ``A``, as a block
    diagonal ``[BT, BT]`` tile. With ``Y = (I + A_ii)^-1 - I``, row r of a block is
    ``-(A_ii[r] + A_ii[r] Y)`` and only rows above r enter: rows 0 and 1 of ``-A_ii`` are final at the
    start, and so are the rows from ``n_rows`` on (zero in every block of a chunk that short)."""
    BT: tl.constexpr = NB * 16
    o = tl.arange(0, 16)
    o_b = tl.arange(0, NB)
    m_same = o_b[:, None, None, None] == o_b[None, None, :, None]          # [NB, 1, NB, 1]
    b_ad = tl.sum(tl.where(m_same, tl.reshape(b_a, (NB, 16, NB, 16)), 0.0), 2)  # [NB, 16, 16]
    b_y = -b_ad
    for r in range(2, tl.minimum(n_rows, 16)):
        m_r = (o == r)[None, :, None]
        b_ar = tl.sum(tl.where(m_r, b_ad, 0.0), 1)                          # row r of each block
        b_yr = -b_ar - tl.sum(b_ar[:, :, None] * b_y, 1)
        b_y = tl.where(m_r, b_yr[:, None, :], b_y)
    b_d = b_y + tl.where(o[:, None] == o[None, :], 1.0, 0.0)[None, :, :]
    return tl.reshape(tl.where(m_same, b_d[:, :, None, :], 0.0), (BT, BT))


@triton.jit(do_not_specialize=["N"])
def chunk_gdn_solve_kernel(
    k,
    beta,
    gc,
    a_inv,
    rk,
    cu_seqlens,
    N,
    stride_k_t,
    stride_k_h,
    stride_b_t,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    BT: tl.constexpr,
    NK: tl.constexpr,
    BN: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    LOWP_QK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_s, i_hv = tl.program_id(0), tl.program_id(1)
    i_hk = i_hv // (HV // HK)
    _, t0, eos = chunk_bounds(cu_seqlens, i_s, N, BT, BN)
    if t0 >= eos:
        return
    NB: tl.constexpr = BT // 16
    o_t = tl.arange(0, BT)
    o_tok = t0 + o_t
    m_t = o_tok < eos
    b_beta = tl.load(beta + o_tok * stride_b_t + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_gc = tl.load(gc + o_tok * HV + i_hv, mask=m_t, other=0.0)

    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    b_ss = tl.zeros([BT], dtype=tl.float32)
    for i_k in tl.static_range(NK):
        o_k = i_k * KTILE + tl.arange(0, KTILE)
        b_k = tl.load(k + o_tok[:, None] * stride_k_t + i_hk * stride_k_h + o_k[None, :],
                      mask=m_t[:, None] & (o_k < DK)[None, :], other=0.0)
        b_kf = b_k.to(tl.float32)
        if LOWP_QK:
            b_kk += tl.dot(b_k, tl.trans(b_k))
        else:
            b_kk += tl.dot(b_kf, tl.trans(b_kf), input_precision=DOT_PRECISION)
        b_ss += tl.sum(b_kf * b_kf, 1)
    b_rk = tl.full([BT], 1.0, tl.float32)
    if USE_QK_L2NORM:
        b_rk = 1.0 / tl.sqrt(b_ss + 1e-6)
    tl.store(rk + o_tok * HV + i_hv, b_rk, mask=m_t)

    m_strict = (o_t[:, None] > o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_decay = tl.exp(tl.where(m_strict, b_gc[:, None] - b_gc[None, :], 0.0))
    b_a = tl.where(m_strict, b_kk * (b_beta * b_rk)[:, None] * b_rk[None, :] * b_decay, 0.0)
    b_inv = _invert_diagonal_blocks(b_a, eos - t0, NB)
    if NB > 1:
        m_off = (o_t // 16)[:, None] > (o_t // 16)[None, :]
        b_p = tl.dot(b_inv, tl.where(m_off, b_a, 0.0), input_precision=DOT_PRECISION)
        b_eye = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
        b_term = -b_p
        b_series = b_eye + b_term
        for _ in tl.static_range(2, NB):
            b_term = -tl.dot(b_term, b_p, input_precision=DOT_PRECISION)
            b_series += b_term
        b_inv = tl.dot(b_series, b_inv, input_precision=DOT_PRECISION)
    tl.store(a_inv + o_tok[:, None] * (HV * BT) + i_hv * BT + o_t[None, :], b_inv, mask=m_t[:, None])


def launch_config(dk: int, chunk_size: int) -> dict:
    """Eight warps: at Dk = 128 ptxas then needs no spill on sm_90 (four warps: 168 bytes; sm_80 spills
    about 850 bytes either way; python -m kernels.compile_check --match gdn.chunk_solve)."""
    assert chunk_size % BLOCK == 0 and chunk_size // BLOCK in (1, 2, 4), f"chunk_size={chunk_size}"
    return {"NK": k_tiles(dk), "num_warps": 8, "num_stages": 2}


def launch_solve(k, beta, gc, cu_seqlens, chunk_size, use_qk_l2norm, lowp_qk, a_inv, rk) -> None:
    """Fills ``a_inv [T, Hv, BT]`` and ``rk [T, Hv]`` at every token inside a row; inputs already in the
    kernel's form."""
    num_tokens, hk, dk = k.shape
    hv = gc.shape[1]
    n = cu_seqlens.shape[0] - 1
    cfg = launch_config(dk, chunk_size)
    chunk_gdn_solve_kernel[(num_slots(num_tokens, n, chunk_size), hv)](
        k, beta, gc, a_inv, rk, cu_seqlens, n, k.stride(0), k.stride(1), beta.stride(0),
        HK=hk, HV=hv, DK=dk, BT=chunk_size, NK=cfg["NK"], BN=triton.next_power_of_2(n),
        USE_QK_L2NORM=use_qk_l2norm, LOWP_QK=lowp_qk, DOT_PRECISION="tf32x3",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def lowp_products(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``q k^T`` / ``k k^T`` take the 16-bit inputs as they are (a CUDA tensor core product, exact
    into float32); float32 products otherwise."""
    return q.is_cuda and q.dtype == k.dtype and q.dtype in (torch.bfloat16, torch.float16)
