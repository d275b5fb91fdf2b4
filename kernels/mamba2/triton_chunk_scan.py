"""Triton kernels for the chunked Mamba2 (SSD) scan, for prefill: two launches.

Chunks are cut at absolute multiples of ``BT`` (the chunk size): a row whose first token sits at
absolute position ``p`` and has ``L`` tokens covers the chunks ``p // BT .. (p + L - 1) // BT``, the
first and last possibly partial. Chunk slots are numbered without reading ``cu_seqlens`` on the
host: row i's chunks take the slots from ``cu[i] // BT + 2 i`` on (a row has at most ``L // BT + 2``
chunks), so ``T // BT + 2 N`` slots cover every chunk; a program of the output kernel finds its row
by comparing its slot with every row's first slot.

1. ``ssd_state_kernel``, one program per (row, head, block of P, block of N), the only
   sequential part: it keeps the state ``[BP, N]`` in registers, stores the state at each chunk start
   to scratch, then ``S = e^{c_last} S + sum_j e^{c_last - c_j} (x_j dt_j) B_j^T`` over the chunk's
   tokens (``c``: the cumulative ``dt * A`` inside the chunk), writes the states at block boundaries
   and the final state to the pool.
2. ``ssd_output_kernel``, one program per (block of P and of ``BI`` query tokens, chunk slot, head),
   all chunks in parallel:
   ``y_i = sum_{j <= i} (C_i . B_j) e^{c_i - c_j} x_j dt_j + e^{c_i} C_i . S_start + D x_i``.

Each program reads only its own row's tokens and does its reductions in a fixed order, so a row's
result does not depend on its neighbours. Products: ``C B^T`` from 16-bit inputs on tensor cores
(exact products, float32 accumulator); every product with a float32 operand (the state, ``x dt``,
the decayed scores, float32 inputs) in ``tf32x3``, close to full float32 (the prefill hands its
state to the recurrent decode). Under the interpreter every product is a float32 one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import as_contiguous, as_index, unit_stride, write_back
from kernels.constants import PAD_SLOT_ID
from kernels.mamba2.contract import check_ssd_chunk_scan_inputs
from kernels.mamba2.triton_state_update import kernel_inputs, kernel_pool


@triton.jit
def _row_of_slot(cu_seqlens, i_s, N, BT: tl.constexpr, BR: tl.constexpr):
    """(row, chunk within the row) of chunk slot ``i_s``; row i's slots start at cu[i] // BT + 2 i."""
    o_r = tl.arange(0, BR)
    m_r = o_r < N
    b_first = tl.load(cu_seqlens + o_r, mask=m_r, other=0) // BT + 2 * o_r
    i_n = tl.sum(tl.where(m_r & (b_first <= i_s), 1, 0), 0) - 1
    i_c = i_s - (tl.load(cu_seqlens + i_n) // BT + 2 * i_n)
    return i_n, i_c


@triton.jit
def _chunk_cum(dt, A, t0, length, i_h, stride_dt_t, o_t, BT: tl.constexpr):
    """Cumulative ``dt * A`` over the chunk's tokens ``t0 .. t0 + length - 1`` (``[BT]``, constant past
    the last token) and the masked ``dt``."""
    m_t = o_t < length
    b_dt = tl.load(dt + (t0 + o_t) * stride_dt_t + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_cum = tl.cumsum(b_dt * tl.load(A + i_h).to(tl.float32), 0)
    return b_cum, b_dt, m_t


@triton.jit
def _chunk_span(i_c, p0, length, BT: tl.constexpr):
    """Offsets ``[s, e)`` inside the row of its chunk ``i_c`` (chunks cut at absolute multiples of BT)."""
    c_abs = (p0 // BT + i_c) * BT
    s = tl.maximum(c_abs - p0, 0)
    e = tl.minimum(c_abs + BT - p0, length)
    return s, e


@triton.heuristics({
    "HAS_INIT_FLAGS": lambda args: args["has_initial_state"] is not None,
    "HAS_START": lambda args: args["start_positions"] is not None,
    "HAS_BLOCKS": lambda args: args["block_state_indices"] is not None,
})
@triton.jit(do_not_specialize=["block_size", "num_block_cols"])
def ssd_state_kernel(
    x, dt, A, B, h_buf, ssm_state, cu_seqlens, state_indices, has_initial_state, start_positions,
    block_state_indices, block_size, num_block_cols,
    stride_x_t, stride_x_h, stride_dt_t, stride_b_t, stride_b_g, stride_blk_n,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_INIT_FLAGS: tl.constexpr, HAS_START: tl.constexpr, HAS_BLOCKS: tl.constexpr,
):
    i_nh, i_p, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # rows x heads: axis 0
    i_n, i_h = i_nh // H, i_nh % H
    i_g = i_h // (H // G)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    i_slot = tl.load(state_indices + i_n).to(tl.int64)
    if (eos <= bos) | (i_slot == PAD):
        return
    length = eos - bos
    p0 = tl.zeros([], dtype=tl.int64)
    if HAS_START:
        p0 = tl.load(start_positions + i_n).to(tl.int64)
    num_chunks = (p0 + length - 1) // BT - p0 // BT + 1
    first_slot = bos // BT + 2 * i_n

    o_t = tl.arange(0, BT)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = i_k * BN + tl.arange(0, BN)
    m_p = o_p < P
    m_n = o_n < N
    m_s = m_p[:, None] & m_n[None, :]
    o_s = i_h * P * N + o_p[:, None] * N + o_n[None, :]          # offsets inside one state [H, P, N]

    b_s = tl.zeros([BP, BN], dtype=tl.float32)
    use_init = True
    if HAS_INIT_FLAGS:
        use_init = tl.load(has_initial_state + i_n) != 0
    if use_init:
        b_s = tl.load(ssm_state + i_slot * H * P * N + o_s, mask=m_s, other=0.0).to(tl.float32)

    for i_c in range(num_chunks):
        tl.store(h_buf + (first_slot + i_c) * H * P * N + o_s, b_s, mask=m_s)
        s, e = _chunk_span(i_c, p0, length, BT)
        t0 = bos + s
        b_cum, b_dt, m_t = _chunk_cum(dt, A, t0, e - s, i_h, stride_dt_t, o_t, BT)
        b_last = tl.sum(tl.where(o_t == e - s - 1, b_cum, 0.0), 0)
        b_x = tl.load(x + (t0 + o_t)[:, None] * stride_x_t + i_h * stride_x_h + o_p[None, :],
                      mask=m_t[:, None] & m_p[None, :], other=0.0).to(tl.float32)      # [BT, BP]
        b_w = tl.where(m_t, tl.exp(b_last - b_cum) * b_dt, 0.0)                          # [BT]
        b_b = tl.load(B + (t0 + o_t)[:, None] * stride_b_t + i_g * stride_b_g + o_n[None, :],
                      mask=m_t[:, None] & m_n[None, :], other=0.0).to(tl.float32)      # [BT, BN]
        b_s = b_s * tl.exp(b_last)
        b_s = tl.dot(tl.trans(b_x * b_w[:, None]), b_b, b_s, input_precision=DOT_PRECISION)
        if HAS_BLOCKS:
            end = p0 + e
            if end % block_size == 0:
                j = end // block_size - p0 // block_size - 1
                i_blk = tl.load(block_state_indices + i_n * stride_blk_n + j, mask=j < num_block_cols,
                                other=PAD).to(tl.int64)
                if i_blk != PAD:
                    p_blk = ssm_state + i_blk * H * P * N + o_s
                    tl.store(p_blk, b_s.to(ssm_state.dtype.element_ty), mask=m_s)
    tl.store(ssm_state + i_slot * H * P * N + o_s, b_s.to(ssm_state.dtype.element_ty), mask=m_s)


@triton.heuristics({"HAS_START": lambda args: args["start_positions"] is not None})
@triton.jit
def ssd_output_kernel(
    x, dt, A, B, C, D, y, h_buf, cu_seqlens, state_indices, start_positions, N_ROWS,
    stride_x_t, stride_x_h, stride_dt_t, stride_b_t, stride_b_g, stride_c_t, stride_c_g,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BT: tl.constexpr, BI: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
    PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, LOWP_CB: tl.constexpr, HAS_START: tl.constexpr,
):
    i_pi, i_s, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_p, i_i = i_pi // (BT // BI), i_pi % (BT // BI)
    i_n, i_c = _row_of_slot(cu_seqlens, i_s, N_ROWS, BT, BR)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    length = eos - bos
    if length <= 0:
        return
    if tl.load(state_indices + i_n) == PAD:
        return
    p0 = tl.zeros([], dtype=tl.int64)
    if HAS_START:
        p0 = tl.load(start_positions + i_n).to(tl.int64)
    num_chunks = (p0 + length - 1) // BT - p0 // BT + 1
    if i_c >= num_chunks:
        return
    s, e = _chunk_span(i_c, p0, length, BT)
    if i_i * BI >= e - s:
        return
    t0 = bos + s
    i_g = i_h // (H // G)

    o_t = tl.arange(0, BT)                       # the chunk's tokens (keys)
    o_i = i_i * BI + tl.arange(0, BI)            # this program's query tokens
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p = o_p < P
    m_n = o_n < N
    m_i = o_i < e - s
    b_cum, b_dt, m_t = _chunk_cum(dt, A, t0, e - s, i_h, stride_dt_t, o_t, BT)
    # The query rows' cumulative decay: rows i_i * BI .. of the same cumsum (the same bits as the keys').
    b_rows = tl.reshape(b_cum, (BT // BI, BI))
    b_cum_i = tl.sum(tl.where((tl.arange(0, BT // BI) == i_i)[:, None], b_rows, 0.0), 0)   # [BI]

    b_c = tl.load(C + (t0 + o_i)[:, None] * stride_c_t + i_g * stride_c_g + o_n[None, :],
                  mask=m_i[:, None] & m_n[None, :], other=0.0)                           # [BI, BN]
    b_b = tl.load(B + (t0 + o_t)[:, None] * stride_b_t + i_g * stride_b_g + o_n[None, :],
                  mask=m_t[:, None] & m_n[None, :], other=0.0)                           # [BT, BN]
    if LOWP_CB:
        b_m = tl.dot(b_c, tl.trans(b_b))                                                  # [BI, BT]
    else:
        b_m = tl.dot(b_c.to(tl.float32), tl.trans(b_b.to(tl.float32)), input_precision=DOT_PRECISION)
    causal = (o_i[:, None] >= o_t[None, :]) & m_t[None, :]
    # (C_i . B_j) e^{c_i - c_j} dt_j, zero above the diagonal
    b_m = b_m * tl.exp(tl.where(causal, b_cum_i[:, None] - b_cum[None, :], float("-inf"))) * b_dt[None, :]

    # The start state's part first, e^{c_i} C_i . S_start, as the accumulator of the intra-chunk product.
    p_h = h_buf + (bos // BT + 2 * i_n + i_c) * H * P * N + i_h * P * N
    b_h = tl.load(p_h + o_p[:, None] * N + o_n[None, :], mask=m_p[:, None] & m_n[None, :], other=0.0)
    b_ce = b_c.to(tl.float32) * tl.exp(b_cum_i)[:, None]                                # [BI, BN]
    b_y = tl.dot(b_ce, tl.trans(b_h), input_precision=DOT_PRECISION)                    # [BI, BP]
    b_x = tl.load(x + (t0 + o_t)[:, None] * stride_x_t + i_h * stride_x_h + o_p[None, :],
                  mask=m_t[:, None] & m_p[None, :], other=0.0).to(tl.float32)            # [BT, BP]
    b_y = tl.dot(b_m, b_x, b_y, input_precision=DOT_PRECISION)                          # [BI, BP]
    m_y = m_i[:, None] & m_p[None, :]
    b_xi = tl.load(x + (t0 + o_i)[:, None] * stride_x_t + i_h * stride_x_h + o_p[None, :],
                   mask=m_y, other=0.0).to(tl.float32)                                   # [BI, BP]
    b_y += tl.load(D + i_h).to(tl.float32) * b_xi
    tl.store(y + (t0 + o_i)[:, None] * H * P + i_h * P + o_p[None, :], b_y.to(y.dtype.element_ty), mask=m_y)


def launch_config(p: int, n: int, chunk_size: int, lowp: bool) -> dict:
    """Block sizes and warps (shared with kernels/mamba2/compile_cases.py). The state kernel splits P
    and N (the update is independent per state entry), the output kernel P and the chunk's query
    tokens, to keep each program's tiles in registers: at the released shapes neither spills on
    sm_80 or sm_90 with 16-bit inputs (python -m kernels.compile_check --match mamba2); wider output
    tiles made ptxas fall back to a 32-register allocation with kilobytes of stack on sm_80."""
    bn = max(16, triton.next_power_of_2(n))  # tl.dot takes dimensions of 16 and more
    bp = max(16, triton.next_power_of_2(p))
    return {
        "state": {"BP": min(bp, 32), "BN": 16, "num_warps": 4, "num_stages": 2},
        "output": {"BI": 16, "BP": min(bp, 32), "BN": bn, "num_warps": 4, "num_stages": 2},
        "DOT_PRECISION": "tf32x3",
        "LOWP_CB": lowp,
    }


def triton_ssd_chunk_scan(
    x, dt, A, B, C, D, ssm_state, cu_seqlens, state_indices, has_initial_state, *,
    start_positions=None, chunk_size=128, block_size=None, block_state_indices=None,
):
    """Triton wrapper; same contract as ``kernels.mamba2.ssd_chunk_scan``."""
    num_tokens, h, p, g, n, rows = check_ssd_chunk_scan_inputs(
        x, dt, A, B, C, D, ssm_state, cu_seqlens, state_indices, has_initial_state, start_positions,
        chunk_size, block_size, block_state_indices)
    x, dt, A, B, C, D, cu_seqlens = kernel_inputs(x, dt, A, B, C, D, cu_seqlens)
    state_indices, start_positions = as_index(state_indices), as_index(start_positions)
    block_state_indices = as_index(block_state_indices)
    has_initial_state = as_contiguous(has_initial_state)
    assert state_indices.dtype == torch.int32 and unit_stride(state_indices), "state_indices: int32"
    y = torch.zeros(num_tokens, h, p, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or rows == 0:
        return y
    pool = kernel_pool(ssm_state)
    # Under the interpreter every product is a float32 one (it gets 16-bit dots wrong).
    lowp = B.is_cuda and B.dtype == C.dtype and B.dtype in (torch.bfloat16, torch.float16)
    cfg = launch_config(p, n, chunk_size, lowp)
    num_slots = num_tokens // chunk_size + 2 * rows  # chunk slots, no host read of cu_seqlens (docstring)
    h_buf = torch.empty(num_slots, h, p, n, dtype=torch.float32, device=x.device)  # chunk-start states
    common = {"H": h, "G": g, "P": p, "N": n, "BT": chunk_size, "PAD": PAD_SLOT_ID,
              "DOT_PRECISION": cfg["DOT_PRECISION"]}
    st = cfg["state"]
    blocks = block_state_indices
    # rows x heads on axis 0 (2^31 - 1 programs): axes 1 and 2 take 65535, 512 rows of 128 heads.
    ssd_state_kernel[(rows * h, triton.cdiv(p, st["BP"]), triton.cdiv(n, st["BN"]))](
        x, dt, A, B, h_buf, pool, cu_seqlens, state_indices, has_initial_state, start_positions,
        blocks, block_size or 1, 0 if blocks is None else blocks.shape[1],
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1),
        0 if blocks is None else blocks.stride(0),
        BP=st["BP"], BN=st["BN"], num_warps=st["num_warps"], num_stages=st["num_stages"], **common,
    )
    out = cfg["output"]
    ssd_output_kernel[(triton.cdiv(p, out["BP"]) * (chunk_size // out["BI"]), num_slots, h)](
        x, dt, A, B, C, D, y, h_buf, cu_seqlens, state_indices, start_positions, rows,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        BI=out["BI"], BP=out["BP"], BN=out["BN"], BR=triton.next_power_of_2(rows), LOWP_CB=cfg["LOWP_CB"],
        num_warps=out["num_warps"], num_stages=out["num_stages"], **common,
    )
    write_back(ssm_state, pool)
    return y
