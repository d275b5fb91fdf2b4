"""References for ``reshape_and_cache`` (and ``token_rows``, shared with the attention reference).

A slot ``s`` addresses block ``s // block_size``, offset ``s % block_size`` of a paged cache
``[num_blocks, block_size, Hkv, D]``; ``PAD_SLOT_ID`` marks a token that is not stored.
"""

from __future__ import annotations

import torch

from kernels.constants import PAD_SLOT_ID
from kernels.kv_cache.contract import check_reshape_and_cache_inputs


def naive_reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``k, v [T, Hkv, D]`` into the caches at ``slot_mapping [T]`` (in place)."""
    check_reshape_and_cache_inputs(k, v, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    keep = slot_mapping != PAD_SLOT_ID
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def token_rows(query_start_loc: torch.Tensor) -> torch.Tensor:
    """Row index (int64) of every token in ``[0, query_start_loc[N])``."""
    num_tokens = int(query_start_loc[-1])
    tokens = torch.arange(num_tokens, dtype=query_start_loc.dtype, device=query_start_loc.device)
    # Row of token t = number of rows ending at or before t.
    return torch.searchsorted(query_start_loc[1:], tokens, right=True)
