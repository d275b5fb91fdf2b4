"""Triton kernels for ``prepare_inputs`` and ``post_update`` (see naive.py for the spec).

Neither wrapper reads a device value on the host: the number of real tokens, the row lengths and
the request slots are only read inside the kernels, so both can be queued on a stream without a
synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import as_contiguous, as_index, unit_stride, with_unit_stride, write_back
from kernels.constants import PAD_SLOT_ID
from kernels.input_prep.contract import check_post_update_inputs, check_prepare_inputs_inputs


@triton.jit
def prepare_inputs_kernel(
    idx_mapping, query_start_loc, is_decode, num_computed, last_sampled, draft_tokens, token_ids, block_table,
    input_ids, positions, seq_lens, slot_mapping,
    N, num_tokens_padded, max_len, max_blocks, stride_d, stride_tok, stride_bt,
    K: tl.constexpr, BLOCK_SIZE: tl.constexpr, BT: tl.constexpr, PAD_ID: tl.constexpr,
):
    # Programs 0..N-1: one step row each. Program N: the padding tokens past query_start_loc[N].
    i_n = tl.program_id(0)
    if i_n == N:
        bos = tl.load(query_start_loc + N)
        for i_t in range(tl.cdiv(num_tokens_padded - bos, BT)):
            o_t = bos + i_t * BT + tl.arange(0, BT)
            mask_t = o_t < num_tokens_padded
            b_zero = tl.zeros([BT], dtype=tl.int64)
            tl.store(input_ids + o_t, b_zero, mask=mask_t)
            tl.store(positions + o_t, b_zero, mask=mask_t)
            tl.store(slot_mapping + o_t, b_zero + PAD_ID, mask=mask_t)
    else:
        bos = tl.load(query_start_loc + i_n)
        q = tl.load(query_start_loc + i_n + 1) - bos
        i_r = tl.load(idx_mapping + i_n)
        is_real = i_r >= 0
        # A padding row reads nothing: its slot is clamped to 0 only to keep the pointers in range.
        i_r64 = tl.maximum(i_r, 0).to(tl.int64)
        n_comp = tl.load(num_computed + i_r64, mask=is_real, other=0).to(tl.int32)
        is_dec = tl.load(is_decode + i_n) != 0
        tl.store(seq_lens + i_n, tl.where(is_real, n_comp + q, 0).to(tl.int32))
        b_last = tl.load(last_sampled + i_r64, mask=is_real & is_dec, other=0).to(tl.int64)
        # Row-wide conditions enter the token masks as lengths (tokens j < n_* qualify): a scalar
        # boolean broadcast against a token vector is avoided.
        n_real = tl.where(is_real, q, 0)
        n_dec = tl.where(is_real & is_dec, q, 0)
        n_pre = n_real - n_dec
        p_draft = draft_tokens + i_r64 * stride_d
        p_tok = token_ids + i_r64 * stride_tok
        p_bt = block_table + i_r64 * stride_bt
        for i_t in range(tl.cdiv(q, BT)):
            o_j = i_t * BT + tl.arange(0, BT)  # token index inside the row
            o_t = bos + o_j
            mask_t = (o_j < q) & (o_t < num_tokens_padded)
            mask_real = mask_t & (o_j < n_real)
            b_pos = n_comp.to(tl.int64) + o_j
            # Decode row: the last sampled token, then the drafts (index clamped as the reference).
            b_draft = tl.zeros([BT], dtype=tl.int64)
            if K > 0:
                o_d = tl.minimum(tl.maximum(o_j - 1, 0), K - 1)
                mask_d = mask_t & (o_j < n_dec) & (o_j > 0)
                b_draft = tl.load(p_draft + o_d, mask=mask_d, other=0).to(tl.int64)
            b_dec = tl.where(o_j == 0, b_last, b_draft)
            # Prefill row: the prompt token at its position (clamped as the reference).
            o_p = tl.minimum(b_pos, max_len - 1)
            b_pre = tl.load(p_tok + o_p, mask=mask_t & (o_j < n_pre), other=0).to(tl.int64)
            b_ids = tl.where(o_j < n_dec, b_dec, b_pre)
            o_b = b_pos // BLOCK_SIZE
            mask_b = mask_real & (o_b < max_blocks)
            b_blk = tl.load(p_bt + o_b, mask=mask_b, other=0).to(tl.int64)
            b_slot = tl.where(mask_b, b_blk * BLOCK_SIZE + b_pos % BLOCK_SIZE, PAD_ID)
            tl.store(input_ids + o_t, tl.where(mask_real, b_ids, 0), mask=mask_t)
            tl.store(positions + o_t, tl.where(mask_real, b_pos, 0), mask=mask_t)
            tl.store(slot_mapping + o_t, b_slot, mask=mask_t)


@triton.jit
def post_update_kernel(
    idx_mapping, query_lens, num_draft_tokens, is_sampling, sampled, num_valid,
    num_computed, num_valid_state, last_sampled, token_ids, num_tokens,
    W, max_len, stride_s, stride_tok,
    BW: tl.constexpr,
):
    # One program per step row; rows map to distinct request slots, so the read-modify-writes of
    # a slot's counters never race.
    i_n = tl.program_id(0)
    i_r = tl.load(idx_mapping + i_n)
    if i_r < 0:
        return
    i_r64 = i_r.to(tl.int64)
    q = tl.load(query_lens + i_n)
    n_draft = tl.load(num_draft_tokens + i_n)
    is_samp = tl.load(is_sampling + i_n) != 0
    n_valid = tl.load(num_valid + i_n)
    n_rejected = tl.where(is_samp, n_draft - (n_valid - 1), 0)
    p_comp = num_computed + i_r64
    tl.store(p_comp, (tl.load(p_comp) + q - n_rejected).to(num_computed.dtype.element_ty))
    tl.store(num_valid_state + i_r64, tl.where(is_samp, n_valid, 1).to(num_valid_state.dtype.element_ty))
    # Sampling rows append their kept tokens at num_tokens[r] and remember the last one.
    p_ntok = num_tokens + i_r64
    n_tok = tl.load(p_ntok)
    p_samp = sampled + i_n * stride_s
    o_c = tl.arange(0, BW)
    n_keep = tl.where(is_samp, n_valid, 0)  # kept tokens; a length, not a broadcast boolean
    mask_c = (o_c < n_keep) & (o_c < W)
    b_tok = tl.load(p_samp + o_c, mask=mask_c, other=0)
    o_dst = n_tok.to(tl.int64) + o_c
    tl.store(token_ids + i_r64 * stride_tok + o_dst, b_tok, mask=mask_c & (o_dst < max_len))
    mask_last = is_samp & (n_valid >= 1) & (n_valid <= W)
    b_last = tl.load(p_samp + n_valid - 1, mask=mask_last, other=0)
    tl.store(last_sampled + i_r64, b_last, mask=mask_last)
    tl.store(p_ntok, (n_tok + n_valid).to(num_tokens.dtype.element_ty), mask=is_samp)


def _assert_kernel_form(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    assert t.dtype in dtypes, f"{name}: expected {dtypes}, got {t.dtype}"
    assert unit_stride(t), f"{name}: needs a unit stride on its last dimension"


def triton_prepare_inputs(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    is_decode: torch.Tensor,
    num_computed: torch.Tensor,
    last_sampled: torch.Tensor,
    draft_tokens: torch.Tensor,
    token_ids: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    num_tokens_padded: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton wrapper; same contract as ``kernels.input_prep.prepare_inputs``."""
    n, _ = check_prepare_inputs_inputs(idx_mapping, query_start_loc, is_decode, num_computed, last_sampled,
                                       draft_tokens, token_ids, block_table, block_size, num_tokens_padded)
    # Every input is read only: converted to the dtypes the kernel is compiled for where it is not.
    idx_mapping, query_start_loc, num_computed, block_table = (
        as_index(t) for t in (idx_mapping, query_start_loc, num_computed, block_table))
    last_sampled, draft_tokens, token_ids = (
        as_index(t, torch.int64) for t in (last_sampled, draft_tokens, token_ids))
    is_decode = as_contiguous(is_decode)
    i32, i64 = torch.int32, torch.int64
    for name, t, dtype in (("idx_mapping", idx_mapping, i32), ("query_start_loc", query_start_loc, i32),
                           ("is_decode", is_decode, torch.bool), ("num_computed", num_computed, i32),
                           ("last_sampled", last_sampled, i64), ("draft_tokens", draft_tokens, i64),
                           ("token_ids", token_ids, i64), ("block_table", block_table, i32)):
        _assert_kernel_form(name, t, (dtype,))
    # query_start_loc[N] <= num_tokens_padded is not checked: it would need a host sync. Tokens
    # past num_tokens_padded are not written.
    device = idx_mapping.device
    input_ids = torch.empty(num_tokens_padded, dtype=torch.int64, device=device)
    positions = torch.empty(num_tokens_padded, dtype=torch.int64, device=device)
    slot_mapping = torch.empty(num_tokens_padded, dtype=torch.int64, device=device)
    seq_lens = torch.empty(n, dtype=torch.int32, device=device)
    prepare_inputs_kernel[(n + 1,)](
        idx_mapping,
        query_start_loc,
        is_decode,
        num_computed,
        last_sampled,
        draft_tokens,
        token_ids,
        block_table,
        input_ids,
        positions,
        seq_lens,
        slot_mapping,
        n,
        num_tokens_padded,
        token_ids.shape[1],
        block_table.shape[1],
        draft_tokens.stride(0),
        token_ids.stride(0),
        block_table.stride(0),
        K=draft_tokens.shape[1],
        BLOCK_SIZE=block_size,
        BT=128,
        PAD_ID=PAD_SLOT_ID,
    )
    return input_ids, positions, seq_lens, slot_mapping


def triton_post_update(
    idx_mapping: torch.Tensor,
    query_lens: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    is_sampling: torch.Tensor,
    sampled: torch.Tensor,
    num_valid: torch.Tensor,
    num_computed: torch.Tensor,
    num_valid_state: torch.Tensor,
    last_sampled: torch.Tensor,
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
) -> None:
    """Triton wrapper; same contract as ``kernels.input_prep.post_update``."""
    n, _ = check_post_update_inputs(
        idx_mapping,
        query_lens,
        num_draft_tokens,
        is_sampling,
        sampled,
        num_valid,
        num_computed,
        num_valid_state,
        last_sampled,
        token_ids,
        num_tokens,
    )
    if n == 0:
        return
    # Read-only inputs: converted to the dtypes the kernel is compiled for where they are not.
    idx_mapping, query_lens, num_draft_tokens, num_valid = (
        as_index(t) for t in (idx_mapping, query_lens, num_draft_tokens, num_valid))
    sampled, is_sampling = as_index(sampled, torch.int64), as_contiguous(is_sampling)
    i32 = torch.int32
    for name, t, dtype in (("idx_mapping", idx_mapping, i32), ("query_lens", query_lens, i32),
                           ("num_draft_tokens", num_draft_tokens, i32), ("num_valid", num_valid, i32),
                           ("sampled", sampled, torch.int64), ("is_sampling", is_sampling, torch.bool)):
        _assert_kernel_form(name, t, (dtype,))
    # Updated in place: int32 or int64 as the caller keeps them (the kernel casts what it stores); a
    # copy, written back, only where the last dimension is strided.
    inplace = (num_computed, num_valid_state, last_sampled, token_ids, num_tokens)
    work = tuple(with_unit_stride(t) for t in inplace)
    for name, t in zip(("num_computed", "num_valid_state", "last_sampled", "token_ids", "num_tokens"), work):
        _assert_kernel_form(name, t, (torch.int32, torch.int64))
    w_computed, w_valid_state, w_last, w_tokens, w_num_tokens = work
    width = sampled.shape[1]
    post_update_kernel[(n,)](
        idx_mapping, query_lens, num_draft_tokens, is_sampling, sampled, num_valid,
        w_computed, w_valid_state, w_last, w_tokens, w_num_tokens,
        width, w_tokens.shape[1], sampled.stride(0), w_tokens.stride(0),
        BW=triton.next_power_of_2(width),
    )
    for original, result in zip(inplace, work):
        write_back(original, result)
