"""``reshape_and_cache``: store K/V into the paged cache (slot mappings come from ``input_prep``)."""

from __future__ import annotations

import torch

from kernels._dispatch import resolve_backend
from kernels.kv_cache.naive import naive_reshape_and_cache


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Store ``k, v [T, Hkv, D]`` into ``k_cache, v_cache [num_blocks, block_size, Hkv, D]`` at the
    int64 slots ``slot_mapping [T]`` (in place); ``PAD_SLOT_ID`` tokens are skipped."""
    if resolve_backend(backend, k, v, k_cache, v_cache, slot_mapping) == "torch":
        return naive_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    from kernels.kv_cache.triton_kv_cache import triton_reshape_and_cache

    return triton_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


__all__ = [
    "naive_reshape_and_cache",
    "reshape_and_cache",
]
