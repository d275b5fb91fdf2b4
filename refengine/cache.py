"""Cache tensors for one engine, allocated from what each layer's mixer declares.

``kv``: paged keys and values per attention layer (and the drafter's layer, key ``"mtp"``, or the caches a
drafter declares of its own, string keys, ``refengine.drafters.base.drafter_cache_specs``): the
pool's ``num_kv_blocks`` blocks, then one sink block (``sink_block``) that no request is ever given,
for block-table entries a row does not own (padding rows, unused columns).
``states``: per-slot recurrent state per recurrent layer, ``S`` slots each: the per-request slots,
then the prefix cache's checkpoint slots. Each state tensor's declaration (``RecurrentState.checkpoint``)
says where it holds the state after a verify step's token j: a ``WINDOW`` (widened by K columns) at
columns j..j+W-2 of s_0, a ``SLOT`` tensor in slot s_j (contract 1). Checkpoints are taken and restored
by that declaration only, so a new recurrent mixer needs nothing here.
"""

from __future__ import annotations

import torch

from refengine.model.cache_specs import WINDOW, PagedKV, RecurrentState
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
        drafter_specs: dict | None = None,  # a drafter's own caches (str keys): drafter_cache_specs
    ):
        self.sink_block = num_kv_blocks  # the block after the pool's blocks
        self.num_speculative_tokens = num_speculative_tokens  # K: columns the conv window is widened by
        self.kv: dict = {}  # layer idx | "mtp" -> (k_cache, v_cache), each [blocks, block_size, Hkv, D]
        self.states: dict = {}  # layer idx -> state tensors, each [S, ...] (GDN: conv [S, C, W-1+K],
        #                         ssm fp32)
        self.checkpoint_kinds: dict = {}  # layer idx -> WINDOW | SLOT per state tensor (its declaration)
        specs = cache_specs(cfg, num_speculative_tokens, drafter_kv)
        for key in drafter_specs or {}:
            if key in specs or not isinstance(key, str):
                raise ValueError(f"drafter cache {key!r}: the key must be a string no target cache uses")
        specs.update(drafter_specs or {})
        for key, spec in specs.items():
            if isinstance(spec, PagedKV):
                self.kv[key] = spec.allocate(num_kv_blocks + 1, block_size, dtype, device)
            elif isinstance(spec, RecurrentState):
                self.states[key] = spec.allocate(num_state_slots, dtype, device)
                self.checkpoint_kinds[key] = spec.checkpoint
            else:
                raise TypeError(f"cache {key!r}: unknown cache declaration {type(spec).__name__}")

    def _tensors(self):
        """(tensor, its checkpoint kind) for every state tensor of every recurrent layer."""
        for layer, tensors in self.states.items():
            yield from zip(tensors, self.checkpoint_kinds[layer])

    def save_checkpoint(self, slots: list[int], column: int, dst: int) -> None:
        """Copy the state after a step's token ``column`` of the request owning ``slots`` (s_0..s_K) into
        checkpoint slot ``dst``: a window's columns ``column ..`` of s_0, a slot tensor of ``s_column``."""
        for t, kind in self._tensors():
            if kind == WINDOW:
                width = t.shape[-1] - self.num_speculative_tokens  # W-1: the unwidened window
                t[dst, ..., :width].copy_(t[slots[0], ..., column: column + width])
            else:
                t[dst].copy_(t[slots[column]])

    def restore_checkpoint(self, src: int, slot0: int) -> None:
        """Copy checkpoint slot ``src`` into a request's s_0 (its initial state for the next prefill)."""
        for t, _ in self._tensors():
            t[slot0].copy_(t[src])

    def save_checkpoints(self, slot0: torch.Tensor, column: torch.Tensor, src: torch.Tensor,
                         dst: torch.Tensor) -> None:
        """``save_checkpoint`` for M copies at once, on the device (no host read): copy m takes a window's
        columns ``column[m] ..`` of ``slot0[m]`` and a slot tensor of ``src[m]`` (the slot s_column of the
        same request) into ``dst[m]``. All [M] int64; ``dst`` may repeat a sink slot."""
        for t, kind in self._tensors():
            if kind == WINDOW:
                width = t.shape[-1] - self.num_speculative_tokens  # W-1: the unwidened window
                cols = column[:, None] + torch.arange(width, device=column.device)  # [M, W-1]
                rows = t[slot0]  # [M, ..., W-1+K]
                index = cols.view(cols.shape[0], *([1] * (rows.dim() - 2)), width)
                t[dst, ..., :width] = rows.gather(-1, index.expand(*rows.shape[:-1], width))
            else:
                t[dst] = t[src]

    def restore_checkpoints(self, src: torch.Tensor, slot0: torch.Tensor) -> None:
        """``restore_checkpoint`` for n requests at once: checkpoint ``src[i]`` into s_0 ``slot0[i]``
        (both [n] int64)."""
        for t, _ in self._tensors():
            t[slot0] = t[src]
