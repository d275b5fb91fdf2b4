"""Step input preparation and post-step update for the async engine (see naive.py for the spec)."""

from __future__ import annotations

from kernels._dispatch import resolve_backend
from kernels.input_prep.naive import naive_post_update, naive_prepare_inputs


def prepare_inputs(
    *,
    idx_mapping,
    query_start_loc,
    is_decode,
    num_computed,
    last_sampled,
    draft_tokens,
    token_ids,
    block_table,
    block_size: int,
    num_tokens_padded: int,
    backend: str | None = None,
):
    """Keyword-only (many look-alike int tensors); see ``naive_prepare_inputs`` for the contract."""
    if resolve_backend(backend, idx_mapping) == "triton":
        from kernels.input_prep.triton_input_prep import triton_prepare_inputs

        return triton_prepare_inputs(idx_mapping, query_start_loc, is_decode, num_computed, last_sampled,
                                     draft_tokens, token_ids, block_table, block_size, num_tokens_padded)
    return naive_prepare_inputs(
        idx_mapping,
        query_start_loc,
        is_decode,
        num_computed,
        last_sampled,
        draft_tokens,
        token_ids,
        block_table,
        block_size,
        num_tokens_padded,
    )


def post_update(*, idx_mapping, query_lens, num_draft_tokens, is_sampling, sampled, num_valid, num_computed,
                num_valid_state, last_sampled, token_ids, num_tokens, backend: str | None = None) -> None:
    """Keyword-only (many look-alike int tensors); see ``naive_post_update`` for the contract."""
    if resolve_backend(backend, idx_mapping) == "triton":
        from kernels.input_prep.triton_input_prep import triton_post_update

        return triton_post_update(idx_mapping, query_lens, num_draft_tokens, is_sampling, sampled, num_valid,
                                  num_computed, num_valid_state, last_sampled, token_ids, num_tokens)
    return naive_post_update(idx_mapping, query_lens, num_draft_tokens, is_sampling, sampled, num_valid,
                             num_computed, num_valid_state, last_sampled, token_ids, num_tokens)


__all__ = ["naive_post_update", "naive_prepare_inputs", "post_update", "prepare_inputs"]
