"""Cache tensors for one engine, allocated from what each layer's mixer declares.

``kv``: paged keys and values per attention layer (and the drafter's layer, key ``"mtp"``): the
pool's ``num_kv_blocks`` blocks, then one sink block (``sink_block``) that no request is ever given,
for block-table entries a row does not own (padding rows, unused columns).
``states``: per-slot recurrent state per recurrent layer, ``S`` slots each: the per-request slots,
then the prefix cache's checkpoint slots. A recurrent layer's first tensor is its conv window, widened
by K columns (the state after a verify step's token j is the window at columns j..j+W-2 of s_0); its
other tensors hold the state after token j in slot s_j (contract 1).
"""

from __future__ import annotations

import torch

from refengine.model.cache_specs import PagedKV, RecurrentState
from refengine.model.registry import cache_specs


class ModelCaches:
    def __init__(
        self,
        cfg,  # the model's config view (its family says what each layer caches)
        num_kv_blocks: int,
        block_size: int,
        num_state_slots: int,
        num_speculative_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        drafter_kv: bool,
    ):
        self.sink_block = num_kv_blocks  # the block after the pool's blocks
        self.num_speculative_tokens = num_speculative_tokens  # K: columns the conv window is widened by
        self.kv: dict = {}  # layer idx | "mtp" -> (k_cache, v_cache), each [blocks, block_size, Hkv, D]
        self.states: dict = {}  # layer idx -> state tensors, each [S, ...] (GDN: conv [S, C, W-1+K],
        #                         ssm fp32)
        for key, spec in cache_specs(cfg, num_speculative_tokens, drafter_kv).items():
            if isinstance(spec, PagedKV):
                self.kv[key] = spec.allocate(num_kv_blocks + 1, block_size, dtype, device)
            elif isinstance(spec, RecurrentState):
                self.states[key] = spec.allocate(num_state_slots, dtype, device)
            else:
                raise TypeError(f"cache {key!r}: unknown cache declaration {type(spec).__name__}")

    def save_checkpoint(self, slots: list[int], column: int, dst: int) -> None:
        """Copy the state after a step's token ``column`` of the request owning ``slots`` (s_0..s_K) into
        checkpoint slot ``dst``, every recurrent layer: conv window columns ``column..`` of s_0 and
        the recurrent state of ``s_column``."""
        for conv, *rest in self.states.values():
            width = conv.shape[2] - (len(slots) - 1)  # W-1: the unwidened window
            conv[dst, :, :width].copy_(conv[slots[0], :, column: column + width])
            for t in rest:
                t[dst].copy_(t[slots[column]])

    def restore_checkpoint(self, src: int, slot0: int) -> None:
        """Copy checkpoint slot ``src`` into a request's s_0 (its initial state for the next prefill)."""
        for conv, *rest in self.states.values():
            conv[slot0].copy_(conv[src])
            for t in rest:
                t[slot0].copy_(t[src])

    def save_checkpoints(self, slot0: torch.Tensor, column: torch.Tensor, src: torch.Tensor,
                         dst: torch.Tensor) -> None:
        """``save_checkpoint`` for M copies at once, on the device (no host read): copy m takes the conv
        window at columns ``column[m] ..`` of ``slot0[m]`` and the recurrent state of ``src[m]`` (the
        slot s_column of the same request) into ``dst[m]``. All [M] int64; ``dst`` may repeat a sink slot.
        """
        for conv, *rest in self.states.values():
            width = conv.shape[2] - self.num_speculative_tokens  # W-1: the unwidened window
            cols = column[:, None] + torch.arange(width, device=column.device)  # [M, W-1]
            window = conv[slot0[:, None], :, cols]  # [M, W-1, C]
            conv[dst, :, :width] = window.transpose(1, 2)
            for t in rest:
                t[dst] = t[src]

    def restore_checkpoints(self, src: torch.Tensor, slot0: torch.Tensor) -> None:
        """``restore_checkpoint`` for n requests at once: checkpoint ``src[i]`` into s_0 ``slot0[i]``
        (both [n] int64)."""
        for tensors in self.states.values():
            for t in tensors:
                t[slot0] = t[src]
