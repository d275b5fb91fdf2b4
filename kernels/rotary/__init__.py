"""``rotary_embedding``: NeoX-style RoPE of q and k on the first ``rotary_dim`` dims of each head (one launch
each for the twenty-odd elementwise ops of the reference)."""

from __future__ import annotations

import torch

from kernels._dispatch import resolve_backend
from kernels.rotary.naive import naive_cos_sin, naive_rotary_embedding, naive_rotate

__all__ = ["naive_cos_sin", "naive_rotary_embedding", "naive_rotate", "rotary_embedding"]


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
                     theta: float, *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, Hq, D]``, ``k [T, Hkv, D]`` (one dtype, unit stride on D), ``positions [T]`` int,
    ``rotary_dim`` even and <= D, ``theta`` > 0 -> q, k rotated (new tensors, contiguous; the dims past
    ``rotary_dim`` kept)."""
    if resolve_backend(backend, q, k) == "torch":
        return naive_rotary_embedding(q, k, positions, rotary_dim, theta)
    from kernels.rotary.triton_rotary import triton_rotary_embedding

    return triton_rotary_embedding(q, k, positions, rotary_dim, theta)
