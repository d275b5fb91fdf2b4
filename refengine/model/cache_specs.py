"""What a mixer declares about its cache, so the engines can allocate it without knowing the mixer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedKV:
    """Keys and values in blocks of ``block_size`` tokens: (k, v), each
    [blocks, block_size, heads, head_dim]."""

    num_kv_heads: int
    head_dim: int

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device
    ) -> tuple[torch.Tensor, ...]:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(2))


@dataclass(frozen=True)
class RecurrentState:
    """Per-slot state tensors: ``shapes[i]`` per slot, in the model dtype or float32 (``fp32[i]``)."""

    shapes: tuple[tuple[int, ...], ...]
    fp32: tuple[bool, ...]

    def allocate(self, num_slots: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros((num_slots, *shape), dtype=torch.float32 if f else dtype, device=device)
                     for shape, f in zip(self.shapes, self.fp32))
