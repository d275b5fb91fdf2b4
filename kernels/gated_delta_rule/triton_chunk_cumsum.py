"""Chunked GDN, phase 1 of 5: the cumulative log decay inside each chunk (reference:
``chunk_phases.chunk_cumsum``).

One program per (chunk slot, block of value heads), all chunks in parallel: ``gc[t] = g[c0] + ... +
g[t]`` over the tokens of t's chunk, in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gated_delta_rule.triton_chunk_common import chunk_bounds, num_slots


@triton.jit(do_not_specialize=["N"])
def chunk_gdn_cumsum_kernel(
    g,
    gc,
    cu_seqlens,
    N,
    stride_g_t,
    HV: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
    BN: tl.constexpr,
):
    i_s, i_hb = tl.program_id(0), tl.program_id(1)
    _, t0, eos = chunk_bounds(cu_seqlens, i_s, N, BT, BN)
    if t0 >= eos:
        return
    o_tok = t0 + tl.arange(0, BT)
    o_h = i_hb * BH + tl.arange(0, BH)
    m = (o_tok < eos)[:, None] & (o_h < HV)[None, :]
    b_g = tl.load(g + o_tok[:, None] * stride_g_t + o_h[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(gc + o_tok[:, None] * HV + o_h[None, :], tl.cumsum(b_g, 0), mask=m)


def launch_config(hv: int) -> dict:
    """Value heads per program: all of them up to 64 (a ``[BT, 64]`` float32 tile)."""
    return {"BH": min(64, triton.next_power_of_2(hv)), "num_warps": 4}


def launch_cumsum(g: torch.Tensor, cu_seqlens: torch.Tensor, chunk_size: int, gc: torch.Tensor) -> None:
    """Fills ``gc [T, Hv]`` float32 at every token inside a row; inputs already in the kernel's form."""
    num_tokens, hv = g.shape
    n = cu_seqlens.shape[0] - 1
    cfg = launch_config(hv)
    grid = (num_slots(num_tokens, n, chunk_size), triton.cdiv(hv, cfg["BH"]))
    chunk_gdn_cumsum_kernel[grid](
        g, gc, cu_seqlens, n, g.stride(0),
        HV=hv, BT=chunk_size, BH=cfg["BH"], BN=triton.next_power_of_2(n), num_warps=cfg["num_warps"],
    )
