"""Chunked GDN, phase 4 of 5: the state pass, the only sequential part (reference:
``naive_phases.chunk_state``).

One program per (row, value head, block of ``BV`` value columns), rows x heads on grid axis 0 (CUDA
takes at most 65535 programs on axes 1 and 2). It walks the row's chunks with its ``[Dk, BV]`` slice
of the state in registers, as up to four ``[64, BV]`` tiles, and per chunk:

1. writes the state at the chunk's start to ``h`` (phase 5 reads it);
2. ``v' = u - w S``, written over ``u`` (only this program reads it again, and phase 5 after it);
3. ``S = exp(gc_last) S + K^T (v' * rk exp(gc_last - gc))``: the decay and the key's L2 norm are
   folded into the ``[BT, BV]`` value tile, not into the wider key tiles.

The final state goes to the pool. A chunk of 16 tokens is handled as a 32-token tile whose second half
is masked: the product ``K^T v'`` then reduces over 32 float32 elements (128 bytes), the narrowest
this package gives ``tl.dot`` (triton_chunk_common.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.constants import PAD_SLOT_ID
from kernels.gated_delta_rule.triton_chunk_common import KTILE, MIN_DOT_K, k_tiles, num_slots


@triton.jit
def _load_tile(p, i_k: tl.constexpr, o_v, m_v, DK: tl.constexpr, DV: tl.constexpr):
    """``[KTILE, BV]`` tile ``i_k`` of a ``[Dk, Dv]`` state, float32."""
    o_k = i_k * KTILE + tl.arange(0, KTILE)
    return tl.load(p + o_k[:, None] * DV + o_v[None, :], mask=(o_k < DK)[:, None] & m_v[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _store_tile(p, b_h, i_k: tl.constexpr, o_v, m_v, DK: tl.constexpr, DV: tl.constexpr):
    o_k = i_k * KTILE + tl.arange(0, KTILE)
    tl.store(p + o_k[:, None] * DV + o_v[None, :], b_h.to(p.dtype.element_ty),
             mask=(o_k < DK)[:, None] & m_v[None, :])


@triton.jit
def _w_times_state(w, b_h, o_tok, m_t, i_hv, i_k: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """``w[:, tile] S[tile]``: ``[BTK, KTILE] @ [KTILE, BV]``."""
    o_k = i_k * KTILE + tl.arange(0, KTILE)
    b_w = tl.load(w + o_tok[:, None] * (HV * DK) + i_hv * DK + o_k[None, :],
                  mask=m_t[:, None] & (o_k < DK)[None, :], other=0.0)
    return tl.dot(b_w, b_h, input_precision=DOT_PRECISION)


@triton.jit
def _update(b_h, b_gamma, k, b_vd, o_tok, m_t, i_hk, stride_k_t, stride_k_h, i_k: tl.constexpr,
            DK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``gamma S[tile] + K[:, tile]^T vd``, the key tile loaded transposed (``[KTILE, BTK]``)."""
    o_k = i_k * KTILE + tl.arange(0, KTILE)
    b_kt = tl.load(k + o_tok[None, :] * stride_k_t + i_hk * stride_k_h + o_k[:, None],
                   mask=(o_k < DK)[:, None] & m_t[None, :], other=0.0).to(tl.float32)
    return b_h * b_gamma + tl.dot(b_kt, b_vd, input_precision=DOT_PRECISION)


@triton.jit
def chunk_gdn_state_kernel(
    k,
    w,
    u,
    gc,
    rk,
    h,
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
    BTK: tl.constexpr,
    NK: tl.constexpr,
    BV: tl.constexpr,
    PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_hk = i_hv // (HV // HK)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    i_slot = tl.load(state_indices + i_n).to(tl.int64)
    if (eos <= bos) | (i_slot == PAD):
        return
    first_slot = bos // BT + i_n
    o_t = tl.arange(0, BTK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    p_pool = ssm_state + i_slot * (HV * DK * DV) + i_hv * (DK * DV)

    b_h0 = tl.zeros([KTILE, BV], dtype=tl.float32)
    b_h1, b_h2, b_h3 = b_h0, b_h0, b_h0
    if tl.load(has_initial_state + i_n):
        b_h0 = _load_tile(p_pool, 0, o_v, m_v, DK, DV)
        if NK > 1:
            b_h1 = _load_tile(p_pool, 1, o_v, m_v, DK, DV)
        if NK > 2:
            b_h2 = _load_tile(p_pool, 2, o_v, m_v, DK, DV)
        if NK > 3:
            b_h3 = _load_tile(p_pool, 3, o_v, m_v, DK, DV)

    for i_c in range(tl.cdiv(eos - bos, BT)):
        t0 = bos + i_c * BT
        o_tok = t0 + o_t
        m_t = (o_t < BT) & (o_tok < eos)
        p_h = h + (first_slot + i_c) * (HV * DK * DV) + i_hv * (DK * DV)
        _store_tile(p_h, b_h0, 0, o_v, m_v, DK, DV)
        if NK > 1:
            _store_tile(p_h, b_h1, 1, o_v, m_v, DK, DV)
        if NK > 2:
            _store_tile(p_h, b_h2, 2, o_v, m_v, DK, DV)
        if NK > 3:
            _store_tile(p_h, b_h3, 3, o_v, m_v, DK, DV)

        p_u = u + o_tok[:, None] * (HV * DV) + i_hv * DV + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_v = tl.load(p_u, mask=m_tv, other=0.0)
        b_v -= _w_times_state(w, b_h0, o_tok, m_t, i_hv, 0, HV, DK, DOT_PRECISION)
        if NK > 1:
            b_v -= _w_times_state(w, b_h1, o_tok, m_t, i_hv, 1, HV, DK, DOT_PRECISION)
        if NK > 2:
            b_v -= _w_times_state(w, b_h2, o_tok, m_t, i_hv, 2, HV, DK, DOT_PRECISION)
        if NK > 3:
            b_v -= _w_times_state(w, b_h3, o_tok, m_t, i_hv, 3, HV, DK, DOT_PRECISION)
        tl.store(p_u, b_v, mask=m_tv)

        b_gc_last = tl.load(gc + (tl.minimum(t0 + BT, eos) - 1) * HV + i_hv)
        b_gc = tl.load(gc + o_tok * HV + i_hv, mask=m_t, other=0.0)
        b_rk = tl.load(rk + o_tok * HV + i_hv, mask=m_t, other=0.0)
        b_scale = tl.where(m_t, b_rk * tl.exp(tl.where(m_t, b_gc_last - b_gc, 0.0)), 0.0)
        b_vd = b_v * b_scale[:, None]
        b_gamma = tl.exp(b_gc_last)
        b_h0 = _update(b_h0, b_gamma, k, b_vd, o_tok, m_t, i_hk, stride_k_t, stride_k_h, 0, DK, DOT_PRECISION)
        if NK > 1:
            b_h1 = _update(b_h1, b_gamma, k, b_vd, o_tok, m_t, i_hk, stride_k_t, stride_k_h, 1, DK,
                           DOT_PRECISION)
        if NK > 2:
            b_h2 = _update(b_h2, b_gamma, k, b_vd, o_tok, m_t, i_hk, stride_k_t, stride_k_h, 2, DK,
                           DOT_PRECISION)
        if NK > 3:
            b_h3 = _update(b_h3, b_gamma, k, b_vd, o_tok, m_t, i_hk, stride_k_t, stride_k_h, 3, DK,
                           DOT_PRECISION)

    _store_tile(p_pool, b_h0, 0, o_v, m_v, DK, DV)
    if NK > 1:
        _store_tile(p_pool, b_h1, 1, o_v, m_v, DK, DV)
    if NK > 2:
        _store_tile(p_pool, b_h2, 2, o_v, m_v, DK, DV)
    if NK > 3:
        _store_tile(p_pool, b_h3, 3, o_v, m_v, DK, DV)


def launch_config(dk: int, dv: int, chunk_size: int) -> dict:
    """``BTK``: the token rows of the per-chunk tiles, at least ``MIN_DOT_K`` (module docstring); 32 value
    columns per program (Dv = 128: four programs per row and head), four warps."""
    return {"NK": k_tiles(dk), "BTK": max(chunk_size, MIN_DOT_K),
            "BV": min(32, max(16, triton.next_power_of_2(dv))), "num_warps": 4, "num_stages": 2}


def launch_state(k, w, u, gc, rk, pool, cu_seqlens, state_indices, has_initial_state, chunk_size,
                 h: torch.Tensor) -> None:
    """Fills ``h [C, Hv, Dk, Dv]``, turns ``u`` into ``v'`` and writes the final states to ``pool``, for
    every row with a state slot; inputs already in the kernel's form."""
    hk, dk = k.shape[1], k.shape[2]
    hv, dv = u.shape[1], u.shape[2]
    n = cu_seqlens.shape[0] - 1
    assert h.shape[0] == num_slots(k.shape[0], n, chunk_size), "h: a slot per chunk"
    cfg = launch_config(dk, dv, chunk_size)
    chunk_gdn_state_kernel[(n * hv, triton.cdiv(dv, cfg["BV"]))](
        k, w, u, gc, rk, h, pool, cu_seqlens, state_indices, has_initial_state, k.stride(0), k.stride(1),
        HK=hk, HV=hv, DK=dk, DV=dv, BT=chunk_size, BTK=cfg["BTK"], NK=cfg["NK"], BV=cfg["BV"],
        PAD=PAD_SLOT_ID, DOT_PRECISION="tf32x3", num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
