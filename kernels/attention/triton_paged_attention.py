"""Triton kernel for ``paged_attention``.

One program per (query block, KV head): a block of ``BLOCK_Q`` consecutive query tokens of one row
together with the ``G = Hq // Hkv`` query heads sharing the KV head, i.e. ``BLOCK_Q * G`` query
rows. The program walks the row's keys in order from position 0, ``TILE`` keys at a time (each
key's block looked up in the block table), with an online softmax in float32 and no split over
the key axis. A tile lying wholly after a token's position is an exact no-op for it (running max
unchanged, rescale ``exp(0) = 1``, nothing added), so a token's result depends only on its
position and the keys: the same whatever else is in the batch and however the prompt is chunked.

``TILE = max(block_size, 16)`` (``tl.dot`` needs 16 on the GPU): with ``block_size >= 16`` the
tiles are the cache blocks, as in the reference; smaller blocks are grouped, which changes only
the rounding.

Programs map to (row, query block) without a host sync: row i's blocks are numbered from
``query_start_loc[i] // BLOCK_Q + i``, which over-counts by at most one block per row, so
``T // BLOCK_Q + N`` programs cover every block and the surplus ones exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import as_index, unit_stride, with_unit_stride
from kernels.attention.contract import check_block_size, check_paged_attention_inputs


@triton.jit(do_not_specialize=["N", "scale"])
def paged_attention_kernel(
    q, k_cache, v_cache, o, query_start_loc, seq_lens, block_table,
    N, scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    G: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
    MATMUL: tl.constexpr,
):
    i_qb, i_kvh = tl.program_id(0), tl.program_id(1)
    # Row i_n owns program ids from query_start_loc[i_n] // BLOCK_Q + i_n on.
    o_n = tl.arange(0, BN)
    b_first = tl.load(query_start_loc + o_n, mask=o_n < N, other=0x3FFFFFFF) // BLOCK_Q + o_n
    i_n = tl.sum((b_first <= i_qb).to(tl.int32), 0) - 1
    if i_n < 0:
        return
    bos = tl.load(query_start_loc + i_n)
    eos = tl.load(query_start_loc + i_n + 1)
    i_local = i_qb - (bos // BLOCK_Q + i_n)
    if i_local * BLOCK_Q >= eos - bos:
        return
    seq_len = tl.load(seq_lens + i_n)
    ctx = seq_len - (eos - bos)

    # Query rows r = (token i_local * BLOCK_Q + r // BG, head i_kvh * G + r % BG).
    o_r = tl.arange(0, BLOCK_Q * BG)
    o_tok = i_local * BLOCK_Q + o_r // BG
    o_g = o_r % BG
    o_d = tl.arange(0, BD)
    o_s = tl.arange(0, TILE)
    mask_r = (o_tok < eos - bos) & (o_g < G)
    mask_d = o_d < D
    mask_rd = mask_r[:, None] & mask_d[None, :]
    b_pos = ctx + o_tok  # rows past the row's end get positions past seq_len: harmless, not stored

    p_q = q + (bos + o_tok[:, None]) * stride_qt + (i_kvh * G + o_g[:, None]) * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=mask_rd, other=0.0)
    if MATMUL != "dot":
        b_q = b_q.to(tl.float32)
    b_m = tl.full([BLOCK_Q * BG], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_Q * BG], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_Q * BG, BD], dtype=tl.float32)
    last_pos = tl.minimum(ctx + (i_local + 1) * BLOCK_Q, seq_len) - 1
    for i_s in range(last_pos // TILE + 1):
        o_key = i_s * TILE + o_s
        mask_s = o_key < seq_len
        p_blk = block_table + i_n * stride_bt + o_key // BLOCK_SIZE
        b_blk = tl.load(p_blk, mask=mask_s, other=0).to(tl.int64)
        o_slot = b_blk * stride_cb + (o_key % BLOCK_SIZE) * stride_cs + i_kvh * stride_ch
        o_kv = o_slot[:, None] + o_d[None, :]
        mask_sd = mask_s[:, None] & mask_d[None, :]
        b_k = tl.load(k_cache + o_kv, mask=mask_sd, other=0.0)  # [TILE, BD]
        b_v = tl.load(v_cache + o_kv, mask=mask_sd, other=0.0)
        if MATMUL == "products":
            b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
            b_s = tl.sum(b_q[:, None, :] * b_k[None, :, :], 2)  # [rows, TILE]
        elif MATMUL == "dot_fp32":
            b_s = tl.dot(b_q, tl.trans(b_k.to(tl.float32)), input_precision="ieee")
        else:
            b_s = tl.dot(b_q, tl.trans(b_k))
        mask_vis = (o_key[None, :] <= b_pos[:, None]) & mask_s[None, :]
        b_s = tl.where(mask_vis, b_s * scale, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_alpha = tl.exp(b_m - b_m_new)
        b_p = tl.exp(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        if MATMUL == "products":
            b_pv = tl.sum(b_p[:, :, None] * b_v[None, :, :], 1)  # [rows, BD]
        elif MATMUL == "dot_fp32":
            b_pv = tl.dot(b_p, b_v.to(tl.float32), input_precision="ieee")
        else:
            b_pv = tl.dot(b_p.to(b_v.dtype), b_v)
        b_acc = b_acc * b_alpha[:, None] + b_pv
        b_m = b_m_new
    b_o = b_acc / b_l[:, None]
    p_o = o + (bos + o_tok[:, None]) * stride_ot + (i_kvh * G + o_g[:, None]) * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=mask_rd)


def attention_matmul(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    """How the kernel forms Q K^T and P V.

    ``"products"`` (Triton interpreter): elementwise products summed with ``tl.sum``. The
    interpreter runs ``tl.dot`` as a NumPy matmul whose BLAS can give a row different bits at
    different row positions (which would break chunking invariance), and gets 16-bit dots wrong.
    ``"dot_fp32"``: float32 ``tl.dot`` in IEEE precision (no TF32). ``"dot"``: 16-bit ``tl.dot``
    with a float32 accumulator (P rounded to the value dtype, as in flash attention), when q and both
    caches share one 16-bit dtype; any other mix is cast to float32 and takes ``"dot_fp32"``.
    """
    if not q.is_cuda:
        return "products"
    if q.dtype == k_cache.dtype == v_cache.dtype != torch.float32:
        return "dot"
    return "dot_fp32"


def launch_constexprs(group: int, head_dim: int, block_size: int, n: int, matmul: str) -> dict:
    """The kernel's compile-time parameters (shared with kernels/attention/compile_cases.py)."""
    bg = triton.next_power_of_2(group)
    return {"G": group, "D": head_dim, "BLOCK_SIZE": block_size, "TILE": max(block_size, 16),
            "BLOCK_Q": max(1, 16 // bg),  # BLOCK_Q * BG >= 16 query rows per program
            "BG": bg, "BD": max(16, triton.next_power_of_2(head_dim)), "BN": triton.next_power_of_2(n),
            "MATMUL": matmul}


def kernel_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches as the kernel reads them: a unit stride over the head dim and one set of strides for
    both. The caches themselves when they already are (the engines' caches); else copies with the
    same (row-major) strides, which the kernel only reads."""
    if unit_stride(k_cache) and k_cache.stride() == v_cache.stride():
        return k_cache, v_cache
    return (k_cache.clone(memory_format=torch.contiguous_format),
            v_cache.clone(memory_format=torch.contiguous_format))


def triton_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """Triton wrapper; same contract as ``kernels.attention.paged_attention``."""
    num_tokens, num_q_heads, head_dim, block_size, num_kv_heads, n = check_paged_attention_inputs(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale)
    check_block_size(block_size)
    q = with_unit_stride(q)
    k_cache, v_cache = kernel_caches(k_cache, v_cache)
    query_start_loc, seq_lens, block_table = (as_index(t) for t in (query_start_loc, seq_lens, block_table))
    assert unit_stride(q) and unit_stride(k_cache), "the head dim of q and the caches must be contiguous"
    assert k_cache.stride() == v_cache.stride(), "the kernel addresses both caches with one set of strides"
    assert query_start_loc.dtype == seq_lens.dtype == block_table.dtype == torch.int32, "int32 row tensors"
    # Padding tokens (past query_start_loc[N]) are never written by the kernel.
    o = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or n == 0:
        return o
    matmul = attention_matmul(q, k_cache, v_cache)
    cfg = launch_constexprs(num_q_heads // num_kv_heads, head_dim, block_size, n, matmul)
    paged_attention_kernel[(num_tokens // cfg["BLOCK_Q"] + n, num_kv_heads)](
        q, k_cache, v_cache, o, query_start_loc, seq_lens, block_table,
        n, scale,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        **cfg,
    )
    return o
