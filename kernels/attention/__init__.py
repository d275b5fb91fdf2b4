"""``paged_attention``: causal varlen attention over a paged KV cache."""

from __future__ import annotations

import torch

from kernels._dispatch import resolve_backend
from kernels.attention.contract import MAX_TRITON_BLOCK_SIZE, check_block_size
from kernels.attention.naive import naive_paged_attention


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    scale: float,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention of ``q [T, Hq, D]`` over ``k_cache, v_cache [num_blocks, block_size, Hkv, D]``.

    ``query_start_loc`` int32 ``[N+1]``, ``seq_lens`` int32 ``[N]`` (context including this step's
    tokens, whose K/V are already cached), ``block_table`` int32 ``[N, max_blocks]``. Token j of
    row i sits at ``seq_lens[i] - qlen_i + j`` and attends to keys ``0 ..= `` that position; query
    head h uses KV head ``h // (Hq // Hkv)``. Returns ``[T, Hq, D]`` in ``q.dtype``, zeros for
    padding tokens.
    """
    tensors = (q, k_cache, v_cache, query_start_loc, seq_lens, block_table)
    if resolve_backend(backend, *tensors) == "torch":
        return naive_paged_attention(*tensors, scale=scale)
    from kernels.attention.triton_paged_attention import triton_paged_attention

    return triton_paged_attention(*tensors, scale=scale)


__all__ = ["MAX_TRITON_BLOCK_SIZE", "check_block_size", "naive_paged_attention", "paged_attention"]
