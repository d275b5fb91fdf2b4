"""Cache tensors for one engine, allocated from what each layer's mixer declares.

``kv``: paged keys and values per attention layer (and the drafter's layer, key ``"mtp"``): the
pool's ``num_kv_blocks`` blocks, then one sink block (``sink_block``) that no request is ever given,
for block-table entries a row does not own (padding rows, unused columns).
``states``: per-slot recurrent state per recurrent layer, ``S`` slots each.
"""

from __future__ import annotations

import torch

from refengine.model.cache_specs import PagedKV, RecurrentState
from refengine.model.config import FULL, ModelConfig
from refengine.model.mixers import mixer_class
from refengine.model.qwen3_next import MTP_CACHE_KEY


class ModelCaches:
    def __init__(self, cfg: ModelConfig, num_kv_blocks: int, block_size: int, num_state_slots: int,
                 num_speculative_tokens: int, dtype: torch.dtype, device: torch.device | str, drafter_kv: bool):
        self.sink_block = num_kv_blocks  # the block after the pool's blocks
        self.kv: dict = {}  # layer idx | "mtp" -> (k_cache, v_cache), each [blocks, block_size, Hkv, D]
        self.states: dict = {}  # layer idx -> state tensors, each [S, ...] (GDN: conv [S, C, W-1+K], ssm fp32)
        for i, layer_type in enumerate(cfg.layer_types):
            spec = mixer_class(layer_type).cache_spec(cfg, num_speculative_tokens)
            if isinstance(spec, PagedKV):
                self.kv[i] = spec.allocate(num_kv_blocks + 1, block_size, dtype, device)
            elif isinstance(spec, RecurrentState):
                self.states[i] = spec.allocate(num_state_slots, dtype, device)
            else:
                raise TypeError(f"layer {i} ({layer_type}): unknown cache declaration {type(spec).__name__}")
        if drafter_kv:
            spec = mixer_class(FULL).cache_spec(cfg, num_speculative_tokens)
            self.kv[MTP_CACHE_KEY] = spec.allocate(num_kv_blocks + 1, block_size, dtype, device)
