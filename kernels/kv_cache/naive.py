"""References for ``reshape_and_cache`` (and ``token_rows``, shared with the attention reference).

A slot ``s`` addresses block ``s // block_size``, offset ``s % block_size`` of a paged cache
``[num_blocks, block_size, Hkv, D]``; ``PAD_SLOT_ID`` marks a token that is not stored.
"""

from __future__ import annotations

import torch

from kernels.constants import PAD_SLOT_ID


def naive_reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``k, v [T, Hkv, D]`` into the caches at ``slot_mapping [T]`` (in place)."""
    assert k.dim() == 3 and v.shape == k.shape, "reshape_and_cache: k, v [T, Hkv, D]"
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, "caches [num_blocks, block_size, Hkv, D]"
    assert k_cache.shape[2:] == k.shape[1:], (
        f"cache heads/dim {tuple(k_cache.shape[2:])} != {tuple(k.shape[1:])}"
    )
    assert slot_mapping.shape == (k.shape[0],), "slot_mapping [T]"
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
