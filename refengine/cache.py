"""Cache tensors for one engine: paged KV per attention layer (and the MTP layer), GDN pools."""

from __future__ import annotations

import torch

from refengine.model.config import ModelConfig


class ModelCaches:
    def __init__(self, cfg: ModelConfig, num_kv_blocks: int, block_size: int, num_state_slots: int,
                 num_spec_tokens: int, dtype: torch.dtype, device: torch.device | str, drafter_kv: bool):
        kv_shape = (num_kv_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
            cfg.linear_num_value_heads * cfg.linear_value_head_dim
        )
        conv_shape = (num_state_slots, conv_dim, cfg.linear_conv_kernel_dim - 1 + num_spec_tokens)
        ssm_shape = (num_state_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                     cfg.linear_value_head_dim)
        self.kv: dict = {}  # layer idx | "mtp" -> (k_cache, v_cache), each [blocks, block_size, Hkv, D]
        self.gdn: dict = {}  # layer idx -> (conv_state [S, C, W-1+K], ssm_state [S, Hv, Dk, Dv] fp32)
        for i, kind in enumerate(cfg.layer_types):
            if kind == "full_attention":
                self.kv[i] = (torch.zeros(kv_shape, dtype=dtype, device=device),
                              torch.zeros(kv_shape, dtype=dtype, device=device))
            else:
                self.gdn[i] = (torch.zeros(conv_shape, dtype=dtype, device=device),
                               torch.zeros(ssm_shape, dtype=torch.float32, device=device))
        if drafter_kv:
            self.kv["mtp"] = (torch.zeros(kv_shape, dtype=dtype, device=device),
                              torch.zeros(kv_shape, dtype=dtype, device=device))

    def fill_state_pools(self, value: float) -> None:
        """Overwrite every GDN slot (tests use it to prove recycled slots are never trusted)."""
        for conv, ssm in self.gdn.values():
            conv.fill_(value)
            ssm.fill_(value)
