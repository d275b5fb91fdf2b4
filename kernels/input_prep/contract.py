"""Input contracts of ``prepare_inputs`` and ``post_update`` (kernels/_contract.py), called first by
both backends. Index and count tensors may be int32 or int64, whichever the caller keeps."""

from __future__ import annotations

from kernels._contract import BOOL, INDEX, Contract


def check_prepare_inputs_inputs(idx_mapping, query_start_loc, is_decode, num_computed, last_sampled,
                                draft_tokens, token_ids, block_table, block_size,
                                num_tokens_padded) -> tuple[int, int]:
    """The contract of ``prepare_inputs`` (kernels/README.md); returns (N, R)."""
    c = Contract("prepare_inputs")
    c.tensor("idx_mapping", idx_mapping, INDEX, "N")
    c.offsets("query_start_loc", query_start_loc)
    c.tensor("is_decode", is_decode, BOOL, "N")
    c.tensor("num_computed", num_computed, INDEX, "R")
    c.tensor("last_sampled", last_sampled, INDEX, "R")
    c.tensor("draft_tokens", draft_tokens, INDEX, "R, K")
    c.tensor("token_ids", token_ids, INDEX, "R, max_len")
    c.at_least("token_ids", "max_len", 1)
    c.tensor("block_table", block_table, INDEX, "R, max_blocks")
    c.integer("block_size", block_size, 1)
    c.integer("num_tokens_padded", num_tokens_padded, 0)
    return c.sizes["N"], c.sizes["R"]


def check_post_update_inputs(idx_mapping, query_lens, num_draft_tokens, is_sampling, sampled, num_valid,
                             num_computed, num_valid_state, last_sampled, token_ids,
                             num_tokens) -> tuple[int, int]:
    """The contract of ``post_update`` (kernels/README.md); returns (N, R)."""
    c = Contract("post_update")
    c.tensor("idx_mapping", idx_mapping, INDEX, "N")
    c.tensor("query_lens", query_lens, INDEX, "N")
    c.tensor("num_draft_tokens", num_draft_tokens, INDEX, "N")
    c.tensor("is_sampling", is_sampling, BOOL, "N")
    c.tensor("sampled", sampled, INDEX, "N, K+1")
    c.at_least("sampled", "K+1", 1)
    c.tensor("num_valid", num_valid, INDEX, "N")
    c.tensor("num_computed", num_computed, INDEX, "R")
    c.tensor("num_valid_state", num_valid_state, INDEX, "R")
    c.tensor("last_sampled", last_sampled, INDEX, "R")
    c.tensor("token_ids", token_ids, INDEX, "R, max_len")
    c.tensor("num_tokens", num_tokens, INDEX, "R")
    return c.sizes["N"], c.sizes["R"]
