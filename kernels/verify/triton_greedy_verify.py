"""Triton kernel for ``greedy_verify``: one program per request row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import as_index, unit_stride, with_unit_stride
from kernels.verify.contract import check_greedy_verify_inputs


@triton.jit
def row_argmax(p_row, V, BV: tl.constexpr):
    """Index of the maximum of ``p_row[0:V]``; the lowest index among ties (as torch.argmax)."""
    b_best = tl.load(p_row).to(tl.float32)
    i_best = tl.full([], 0, dtype=tl.int32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        b_x = tl.load(p_row + o_v, mask=o_v < V, other=float("-inf")).to(tl.float32)
        b_max = tl.max(b_x, 0)
        # Lowest index of this chunk's maximum; a later chunk wins only if strictly larger.
        i_max = tl.min(tl.where(b_x == b_max, o_v, V), 0)
        better = b_max > b_best
        b_best = tl.where(better, b_max, b_best)
        i_best = tl.where(better, i_max, i_best)
    return i_best


@triton.jit
def greedy_verify_kernel(
    target_logits, draft_tokens, num_draft_tokens, cu_num_logits, output_tokens, num_valid,
    V, stride_l, stride_d, stride_o,
    K: tl.constexpr, BV: tl.constexpr,
):
    i_n = tl.program_id(0)
    bos = tl.load(cu_num_logits + i_n).to(tl.int64)
    n_draft = tl.load(num_draft_tokens + i_n).to(tl.int32)
    # live: every earlier draft matched, so target token j is emitted.
    live = tl.full([], 1, dtype=tl.int32)
    n_valid = tl.full([], 0, dtype=tl.int32)
    for j in range(K + 1):
        token = tl.full([], -1, dtype=tl.int64)
        if (live != 0) & (j <= n_draft):
            token = row_argmax(target_logits + (bos + j) * stride_l, V, BV).to(tl.int64)
            n_valid = tl.full([], j + 1, dtype=tl.int32)
            if j < n_draft:
                draft = tl.load(draft_tokens + i_n * stride_d + j)
                live = (draft == token).to(tl.int32)
            else:
                live = tl.full([], 0, dtype=tl.int32)
        tl.store(output_tokens + i_n * stride_o + j, token)
    tl.store(num_valid + i_n, n_valid.to(tl.int32))


def triton_greedy_verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    cu_num_logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton wrapper; same contract as ``kernels.verify.greedy_verify``."""
    n, k = check_greedy_verify_inputs(target_logits, draft_tokens, num_draft_tokens, cu_num_logits)
    target_logits = with_unit_stride(target_logits)
    draft_tokens = as_index(draft_tokens, torch.int64)
    num_draft_tokens, cu_num_logits = as_index(num_draft_tokens), as_index(cu_num_logits)
    assert unit_stride(target_logits), "target_logits rows must be contiguous"
    assert draft_tokens.dtype == torch.int64 and unit_stride(draft_tokens), "draft_tokens: int64 rows"
    for name, t in (("num_draft_tokens", num_draft_tokens), ("cu_num_logits", cu_num_logits)):
        assert t.dtype == torch.int32 and t.is_contiguous(), f"{name}: contiguous int32"
    device = target_logits.device
    output_tokens = torch.empty(n, k + 1, dtype=torch.int64, device=device)
    num_valid = torch.empty(n, dtype=torch.int32, device=device)
    if n == 0:
        return output_tokens, num_valid
    vocab = target_logits.shape[1]
    greedy_verify_kernel[(n,)](
        target_logits, draft_tokens, num_draft_tokens, cu_num_logits, output_tokens, num_valid,
        vocab, target_logits.stride(0), max(draft_tokens.stride(0), 1), output_tokens.stride(0),
        K=k, BV=min(triton.next_power_of_2(vocab), 1024),
    )
    return output_tokens, num_valid
