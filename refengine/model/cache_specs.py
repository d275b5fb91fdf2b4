"""What a mixer declares about its cache, so the engines can allocate it without knowing the mixer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The cache key of the MTP draft head's own attention KV cache (ForwardContext.kv_caches, ModelCaches.kv),
# beside the layer indices; every family with an MTP head declares and reads its cache under it.
MTP_CACHE_KEY = "mtp"


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


WINDOW = "window"  # a conv-style window along its last axis, widened by K columns
SLOT = "slot"  # a per-slot state


@dataclass(frozen=True)
class RecurrentState:
    """Per-slot state tensors: ``shapes[i]`` per slot, in the model dtype or float32 (``fp32[i]``).

    ``checkpoint[i]`` says how tensor i holds the state after a verify step's token j, and so how a
    prefix-cache checkpoint is taken from it (contract 1):

    - ``WINDOW``: the last axis is a window of W-1 inputs widened by K columns; the state after token j
      is columns ``j .. j+W-2`` of slot s_0 (a checkpoint keeps those W-1 columns);
    - ``SLOT``: the state after token j is the whole tensor of slot s_j.
    """

    shapes: tuple[tuple[int, ...], ...]
    fp32: tuple[bool, ...]
    checkpoint: tuple[str, ...]

    def __post_init__(self):
        if not len(self.shapes) == len(self.fp32) == len(self.checkpoint):
            raise ValueError(f"RecurrentState: {len(self.shapes)} shapes, {len(self.fp32)} fp32 flags and "
                             f"{len(self.checkpoint)} checkpoint kinds; one each per state tensor")
        bad = [k for k in self.checkpoint if k not in (WINDOW, SLOT)]
        if bad:
            raise ValueError(f"RecurrentState: checkpoint kind {bad[0]!r} is not {WINDOW!r} or {SLOT!r}")

    def allocate(self, num_slots: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros((num_slots, *shape), dtype=torch.float32 if f else dtype, device=device)
                     for shape, f in zip(self.shapes, self.fp32))
