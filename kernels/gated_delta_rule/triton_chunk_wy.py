"""Chunked GDN, phase 3 of 5: the WY representation ``w``, ``u`` (reference: ``naive_phases.chunk_wy``).

One program per (chunk slot, value head), all chunks in parallel: with ``T = a_inv`` of the chunk
(``[BT, BT]``, one load), ``w = T diag(beta exp(gc) rk) K`` over Dk tiles of 64 and
``u = T diag(beta) V`` over value tiles of ``BV``. Every product has a float32 operand (``T``), so
it runs in ``tf32x3`` on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gated_delta_rule.triton_chunk_common import KTILE, chunk_bounds, k_tiles, num_slots


@triton.jit(do_not_specialize=["N"])
def chunk_gdn_wy_kernel(
    k,
    v,
    beta,
    gc,
    a_inv,
    rk,
    w,
    u,
    cu_seqlens,
    N,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_b_t,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    NK: tl.constexpr,
    BV: tl.constexpr,
    BN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_s, i_hv = tl.program_id(0), tl.program_id(1)
    i_hk = i_hv // (HV // HK)
    _, t0, eos = chunk_bounds(cu_seqlens, i_s, N, BT, BN)
    if t0 >= eos:
        return
    o_t = tl.arange(0, BT)
    o_tok = t0 + o_t
    m_t = o_tok < eos
    b_t = tl.load(a_inv + o_tok[:, None] * (HV * BT) + i_hv * BT + o_t[None, :], mask=m_t[:, None], other=0.0)
    b_beta = tl.load(beta + o_tok * stride_b_t + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_gc = tl.load(gc + o_tok * HV + i_hv, mask=m_t, other=0.0)
    b_rk = tl.load(rk + o_tok * HV + i_hv, mask=m_t, other=0.0)
    b_wk = b_beta * tl.exp(b_gc) * b_rk
    for i_k in tl.static_range(NK):
        o_k = i_k * KTILE + tl.arange(0, KTILE)
        m = m_t[:, None] & (o_k < DK)[None, :]
        b_k = tl.load(k + o_tok[:, None] * stride_k_t + i_hk * stride_k_h + o_k[None, :], mask=m, other=0.0)
        b_w = tl.dot(b_t, b_k.to(tl.float32) * b_wk[:, None], input_precision=DOT_PRECISION)
        tl.store(w + o_tok[:, None] * (HV * DK) + i_hv * DK + o_k[None, :], b_w, mask=m)
    for i_v in tl.static_range((DV + BV - 1) // BV):  # constexpr arithmetic: a static trip count
        o_v = i_v * BV + tl.arange(0, BV)
        m = m_t[:, None] & (o_v < DV)[None, :]
        b_v = tl.load(v + o_tok[:, None] * stride_v_t + i_hv * stride_v_h + o_v[None, :], mask=m, other=0.0)
        b_u = tl.dot(b_t, b_v.to(tl.float32) * b_beta[:, None], input_precision=DOT_PRECISION)
        tl.store(u + o_tok[:, None] * (HV * DV) + i_hv * DV + o_v[None, :], b_u, mask=m)


def launch_config(dk: int, dv: int) -> dict:
    """32 value columns a tile, eight warps: 80 bytes of spill at Dk = Dv = 128 on both targets (64 columns
    or four warps: 300 to 1300 bytes; python -m kernels.compile_check --match gdn.chunk_wy)."""
    return {"NK": k_tiles(dk), "BV": 32, "num_warps": 8, "num_stages": 2}


def launch_wy(k, v, beta, gc, a_inv, rk, cu_seqlens, chunk_size, w: torch.Tensor, u: torch.Tensor) -> None:
    """Fills ``w [T, Hv, Dk]`` and ``u [T, Hv, Dv]`` float32 at every token inside a row; inputs already in
    the kernel's form."""
    num_tokens, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    n = cu_seqlens.shape[0] - 1
    cfg = launch_config(dk, dv)
    chunk_gdn_wy_kernel[(num_slots(num_tokens, n, chunk_size), hv)](
        k, v, beta, gc, a_inv, rk, w, u, cu_seqlens, n,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta.stride(0),
        HK=hk, HV=hv, DK=dk, DV=dv, BT=chunk_size, NK=cfg["NK"], BV=cfg["BV"], BN=triton.next_power_of_2(n),
        DOT_PRECISION="tf32x3", num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
