"""Triton kernels for ``fused_moe``: a grouped GEMM over experts, then a fixed-order slot sum.

The T*K (token, slot) pairs are sorted by expert (stable, so by pair index within an expert) and
each expert's pairs are cut into blocks of BM rows; a block holds rows of one expert only. The
block table is built with torch ops on the device, without a host sync: its length is the bound
``cdiv(T*K, BM) + min(E, T*K)`` and surplus blocks are empty (their programs return at once).

1. ``moe_gate_up_kernel``, grid (blocks, cdiv(I, BN)): for a block of expert e,
   ``act[p] = silu(x[t] @ gate_e.T) * (x[t] @ up_e.T)`` (or ``relu(x[t] @ up_e.T)^2`` for the
   non-gated relu² experts) on a BN slice of I, for every pair p = t*K + k in the block (gate and up
   rounded to x.dtype first, as the reference's linear outputs).
2. ``moe_down_kernel``, grid (blocks, cdiv(H, BN)): ``y[p] = act[p] @ w2[e].T`` (in x.dtype).
3. ``moe_combine_kernel``, grid (T, cdiv(H, BH)): ``out[t] = sum_{k=0..K-1} w[t, k] * y[t*K + k]``
   in float32, slot by slot in order.

Batch invariance: each program runs the whole reduction (H, then I) itself in a fixed BK order
(no split-K) and tile sizes are constants, so a pair's row does not depend on which other rows
share its block or its expert; the slot sum is per token. Tile products as in ``kernels.linear``:
``tl.dot`` on the GPU (IEEE float32 for float32 inputs), ``tl.sum`` of products under the
interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import unit_stride, with_unit_stride
from kernels.linear.triton_linear import linear_matmul
from kernels.moe.contract import check_fused_moe_inputs

# Fixed tile sizes (never chosen from T: that would break batch invariance).
BM, BN, BK = 16, 64, 64  # rows (pairs) per block, output columns per program, reduction step
BH = 128  # hidden columns per program of the combine kernel


@triton.jit
def _tile_product(b_acc, b_a, b_b, MATMUL: tl.constexpr):
    """b_acc [BM, BN] += b_a [BM, BK] @ b_b [BK, BN]."""
    if MATMUL == "products":
        b_acc += tl.sum(b_a.to(tl.float32)[:, :, None] * b_b.to(tl.float32)[None, :, :], 1)
    elif MATMUL == "dot_fp32":
        b_acc = tl.dot(b_a, b_b, b_acc, input_precision="ieee")
    else:
        b_acc = tl.dot(b_a, b_b, b_acc)
    return b_acc


@triton.jit(do_not_specialize=["num_pairs"])
def moe_gate_up_kernel(
    x, w13, act, sorted_pairs, block_expert, block_start, block_end,
    num_pairs, H, I,
    stride_xt, stride_we, stride_wn, stride_ap,
    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MATMUL: tl.constexpr,
    RELU2: tl.constexpr,
):
    # RELU2: w13 [E, I, H] holds the up rows only; act = relu(x @ up_e.T)^2 (no gate).
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    row_start = tl.load(block_start + i_b)
    row_end = tl.load(block_end + i_b)
    if row_start >= row_end:
        return
    e = tl.load(block_expert + i_b).to(tl.int64)
    o_r = row_start + tl.arange(0, BM)  # positions in the expert-sorted pair list
    mask_r = o_r < row_end
    o_p = tl.load(sorted_pairs + o_r, mask=mask_r, other=0).to(tl.int64)  # pair ids t*K + k
    o_t = o_p // TOP_K  # token of each pair
    o_n = i_n * BN + tl.arange(0, BN)  # columns of I
    mask_n = o_n < I
    p_w_expert = w13 + e * stride_we
    b_gate = tl.zeros([BM, BN], dtype=tl.float32)
    b_up = tl.zeros([BM, BN], dtype=tl.float32)
    for i_k in range(tl.cdiv(H, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        mask_k = o_k < H
        p_x = x + o_t[:, None] * stride_xt + o_k[None, :]
        b_x = tl.load(p_x, mask=mask_r[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        mask_w = mask_n[None, :] & mask_k[:, None]
        if RELU2:
            p_wu = p_w_expert + o_n[None, :] * stride_wn + o_k[:, None]  # up rows n, as [BK, BN]
        else:
            p_wg = p_w_expert + o_n[None, :] * stride_wn + o_k[:, None]  # gate rows n, as [BK, BN]
            p_wu = p_w_expert + (I + o_n)[None, :] * stride_wn + o_k[:, None]  # up rows I + n
            b_gate = _tile_product(b_gate, b_x, tl.load(p_wg, mask=mask_w, other=0.0), MATMUL)
        b_up = _tile_product(b_up, b_x, tl.load(p_wu, mask=mask_w, other=0.0), MATMUL)
    # Round as the reference does: gate and up to x.dtype, silu(gate) to x.dtype, the product to x.dtype
    # (each product formed in float32: exact for 16-bit inputs, then one rounding); relu2: up to
    # x.dtype, then its square.
    b_up = b_up.to(act.dtype.element_ty).to(tl.float32)
    if RELU2:
        b_relu = tl.where(b_up < 0.0, 0.0, b_up)
        b_act = b_relu * b_relu
    else:
        b_gate = b_gate.to(act.dtype.element_ty).to(tl.float32)
        b_silu = (b_gate / (1.0 + tl.exp(-b_gate))).to(act.dtype.element_ty).to(tl.float32)
        b_act = b_silu * b_up
    p_act = act + o_p[:, None] * stride_ap + o_n[None, :]
    tl.store(p_act, b_act.to(act.dtype.element_ty), mask=mask_r[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def moe_down_kernel(
    act, w2, y, sorted_pairs, block_expert, block_start, block_end,
    num_pairs, H, I,
    stride_ap, stride_we, stride_wn, stride_yp,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MATMUL: tl.constexpr,
):
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    row_start = tl.load(block_start + i_b)
    row_end = tl.load(block_end + i_b)
    if row_start >= row_end:
        return
    e = tl.load(block_expert + i_b).to(tl.int64)
    o_r = row_start + tl.arange(0, BM)
    mask_r = o_r < row_end
    o_p = tl.load(sorted_pairs + o_r, mask=mask_r, other=0).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)  # columns of H
    mask_n = o_n < H
    p_w_expert = w2 + e * stride_we
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i_k in range(tl.cdiv(I, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        mask_k = o_k < I
        p_a = act + o_p[:, None] * stride_ap + o_k[None, :]
        b_a = tl.load(p_a, mask=mask_r[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
        p_w = p_w_expert + o_n[None, :] * stride_wn + o_k[:, None]  # [BK, BN] = w2[e]^T tile
        b_w = tl.load(p_w, mask=mask_n[None, :] & mask_k[:, None], other=0.0)
        b_acc = _tile_product(b_acc, b_a, b_w, MATMUL)
    p_y = y + o_p[:, None] * stride_yp + o_n[None, :]
    tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=mask_r[:, None] & mask_n[None, :])


@triton.jit
def moe_combine_kernel(
    y, topk_weights, out, H,
    stride_yp, stride_wt, stride_ot,
    TOP_K: tl.constexpr, BH: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)
    mask_h = o_h < H
    b_acc = tl.zeros([BH], dtype=tl.float32)
    for k in range(TOP_K):  # fixed slot order
        b_w = tl.load(topk_weights + i_t * stride_wt + k).to(tl.float32)
        p_y = y + (i_t * TOP_K + k).to(tl.int64) * stride_yp + o_h
        b_acc += b_w * tl.load(p_y, mask=mask_h, other=0.0).to(tl.float32)
    tl.store(out + i_t.to(tl.int64) * stride_ot + o_h, b_acc.to(out.dtype.element_ty), mask=mask_h)


def moe_block_table(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_ids [T, K]`` -> (sorted_pairs [T*K], block_expert, block_start, block_end [B]) int32.

    Pairs p = t*K + k sorted by expert (stable); block b covers sorted positions
    [block_start[b], block_end[b]) of expert block_expert[b]; empty blocks have start == end.
    Built with device-side torch ops only (no host sync); B = cdiv(T*K, BM) + min(E, T*K).
    """
    num_pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    sorted_pairs = torch.argsort(flat, stable=True).to(torch.int32)
    # Pairs per expert; scatter_add rather than bincount, which reads its input's maximum back to the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # [E]
    expert_start = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    blocks = (counts + block_m - 1) // block_m  # blocks per expert
    blocks_end = torch.cumsum(blocks, 0)  # one past each expert's last block
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    o_b = torch.arange(num_blocks, device=topk_ids.device)
    block_expert = torch.searchsorted(blocks_end, o_b, right=True)  # E for surplus blocks
    valid = block_expert < num_experts
    e = block_expert.clamp(max=num_experts - 1)
    first = expert_start[e] + (o_b - (blocks_end[e] - blocks[e])) * block_m
    last = torch.minimum(first + block_m, expert_start[e] + counts[e])
    block_start = first.to(torch.int32)
    block_end = torch.where(valid, last, first).to(torch.int32)
    return sorted_pairs, e.to(torch.int32), block_start, block_end


def triton_fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """Triton wrapper; same contract as ``kernels.moe.fused_moe``."""
    t, h, e, i, k = check_fused_moe_inputs(x, w13, w2, topk_weights, topk_ids, activation)
    x, w13, w2, topk_weights = (with_unit_stride(a) for a in (x, w13, w2, topk_weights))
    for name, a in (("x", x), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights)):
        assert unit_stride(a), f"fused_moe: {name} needs a unit stride on its last dimension"
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    num_pairs = t * k
    sorted_pairs, block_expert, block_start, block_end = moe_block_table(topk_ids, e, BM)
    num_blocks = block_expert.shape[0]
    act = torch.empty(num_pairs, i, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, h, dtype=x.dtype, device=x.device)
    matmul = linear_matmul(x)
    moe_gate_up_kernel[(num_blocks, triton.cdiv(i, BN))](
        x, w13, act, sorted_pairs, block_expert, block_start, block_end,
        num_pairs, h, i, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=k, BM=BM, BN=BN, BK=BK, MATMUL=matmul, RELU2=activation == "relu2",
    )
    moe_down_kernel[(num_blocks, triton.cdiv(h, BN))](
        act, w2, y, sorted_pairs, block_expert, block_start, block_end,
        num_pairs, h, i, act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BM=BM, BN=BN, BK=BK, MATMUL=matmul,
    )
    moe_combine_kernel[(t, triton.cdiv(h, BH))](
        y, topk_weights, out, h, y.stride(0), topk_weights.stride(0), out.stride(0),
        TOP_K=k, BH=BH,
    )
    return out
