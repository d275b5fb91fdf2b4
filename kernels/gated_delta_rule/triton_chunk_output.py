"""Chunked GDN, phase 5 of 5: every chunk's output (reference: ``naive_phases.chunk_output``).

One program per (block of ``BV`` value columns, chunk slot, value head), all chunks in parallel. Over
Dk tiles of 64 it accumulates ``q S_chunk`` (``S_chunk = h`` of the slot), ``q k^T`` and the squared
norms of q and k (k loaded transposed, so its norms come out along the columns), then
``o = diag(scale exp(gc) / |q|) q S + (q k^T / (|q| |k|) * scale exp(gc_i - gc_j), j <= i) v'``.
Rows whose state index is ``PAD_SLOT_ID`` are skipped (the composed op's ``o`` is zeros there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.constants import PAD_SLOT_ID
from kernels.gated_delta_rule.triton_chunk_common import KTILE, chunk_bounds, k_tiles, num_slots


@triton.jit(do_not_specialize=["N", "scale"])
def chunk_gdn_output_kernel(
    q,
    k,
    vnew,
    gc,
    h,
    o,
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
    i_n, t0, eos = chunk_bounds(cu_seqlens, i_s, N, BT, BN)
    if (t0 >= eos) | (tl.load(state_indices + i_n) == PAD):
        return
    o_t = tl.arange(0, BT)
    o_tok = t0 + o_t
    m_t = o_tok < eos
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    p_h = h + i_s.to(tl.int64) * (HV * DK * DV) + i_hv * (DK * DV)

    b_qh = tl.zeros([BT, BV], dtype=tl.float32)
    b_qk = tl.zeros([BT, BT], dtype=tl.float32)
    b_sq = tl.zeros([BT], dtype=tl.float32)
    b_sk = tl.zeros([BT], dtype=tl.float32)
    for i_k in tl.static_range(NK):
        o_k = i_k * KTILE + tl.arange(0, KTILE)
        m_k = o_k < DK
        b_q = tl.load(q + o_tok[:, None] * stride_q_t + i_hk * stride_q_h + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_kt = tl.load(k + o_tok[None, :] * stride_k_t + i_hk * stride_k_h + o_k[:, None],
                       mask=m_k[:, None] & m_t[None, :], other=0.0)
        b_qf, b_ktf = b_q.to(tl.float32), b_kt.to(tl.float32)
        if LOWP_QK:
            b_qk += tl.dot(b_q, b_kt)
        else:
            b_qk += tl.dot(b_qf, b_ktf, input_precision=DOT_PRECISION)
        b_sq += tl.sum(b_qf * b_qf, 1)
        b_sk += tl.sum(b_ktf * b_ktf, 0)
        b_h = tl.load(p_h + o_k[:, None] * DV + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_qh += tl.dot(b_qf, b_h, input_precision=DOT_PRECISION)
    b_rq = tl.full([BT], 1.0, tl.float32)
    b_rk = tl.full([BT], 1.0, tl.float32)
    if USE_QK_L2NORM:
        b_rq = 1.0 / tl.sqrt(b_sq + 1e-6)
        b_rk = 1.0 / tl.sqrt(b_sk + 1e-6)

    b_gc = tl.load(gc + o_tok * HV + i_hv, mask=m_t, other=0.0)
    b_qs = b_rq * scale
    m_causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_decay = tl.exp(tl.where(m_causal, b_gc[:, None] - b_gc[None, :], 0.0))
    b_a = tl.where(m_causal, b_qk * b_qs[:, None] * b_rk[None, :] * b_decay, 0.0)
    m_tv = m_t[:, None] & m_v[None, :]
    b_vn = tl.load(vnew + o_tok[:, None] * (HV * DV) + i_hv * DV + o_v[None, :], mask=m_tv, other=0.0)
    b_o = b_qh * (b_qs * tl.exp(b_gc))[:, None] + tl.dot(b_a, b_vn, input_precision=DOT_PRECISION)
    tl.store(o + o_tok[:, None] * (HV * DV) + i_hv * DV + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


def launch_config(dk: int, dv: int) -> dict:
    """32 value columns per program, eight warps (``q k^T`` is recomputed per value block, four at Dv =
    128): 64 columns make ptxas give sm_80 32 registers and a 9 KiB spill stack, four warps spill 0.8 to
    1.3 KiB (python -m kernels.compile_check --match gdn.chunk_output)."""
    return {"NK": k_tiles(dk), "BV": 32, "num_warps": 8, "num_stages": 2}


def launch_output(q, k, vnew, gc, h, cu_seqlens, state_indices, chunk_size, scale, use_qk_l2norm, lowp_qk,
                  o: torch.Tensor) -> None:
    """Writes ``o [T, Hv, Dv]`` at every token of a row with a state slot; inputs already in the kernel's
    form."""
    num_tokens, hk, dk = q.shape
    hv, dv = vnew.shape[1], vnew.shape[2]
    n = cu_seqlens.shape[0] - 1
    cfg = launch_config(dk, dv)
    grid = (triton.cdiv(dv, cfg["BV"]), num_slots(num_tokens, n, chunk_size), hv)
    chunk_gdn_output_kernel[grid](
        q, k, vnew, gc, h, o, cu_seqlens, state_indices, n, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        HK=hk, HV=hv, DK=dk, DV=dv, BT=chunk_size, NK=cfg["NK"], BV=cfg["BV"], BN=triton.next_power_of_2(n),
        PAD=PAD_SLOT_ID, USE_QK_L2NORM=use_qk_l2norm, LOWP_QK=lowp_qk, DOT_PRECISION="tf32x3",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
