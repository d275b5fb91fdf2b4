"""Gated full attention: q/k RMSNorm, partial NeoX RoPE, paged attention, sigmoid output gate."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

import kernels
from refengine.forward_context import ForwardContext
from refengine.model.cache_specs import PagedKV
from refengine.model.layers import Linear, PartialRotary, RMSNorm, sigmoid

if TYPE_CHECKING:  # a family's view; importing it at run time would make this shared module a family's
    from refengine.model.qwen3_next.config import Qwen3NextConfig


def paged_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext,
                 cache_key: int | str, scale: float) -> torch.Tensor:
    """Write this step's k/v ([T, Hkv, D], contiguous) into the paged cache ``ctx.kv_caches[cache_key]``
    and attend q ([T, Hq, D]) over it; returns [T, Hq, D]. Every attention mixer's cache step."""
    attn = ctx.attn
    k_cache, v_cache = ctx.kv_caches[cache_key]
    kernels.reshape_and_cache(k, v, k_cache, v_cache, attn.slot_mapping)
    return kernels.paged_attention(
        q, k_cache, v_cache, attn.query_start_loc, attn.seq_lens, attn.block_table, scale=scale
    )


class GatedAttention(nn.Module):
    """q_proj yields, per head, D query dims then D gate dims; the output is attn * sigmoid(gate).

    Cache: ``ctx.kv_caches[cache_key] = (k_cache, v_cache)``, each [blocks, block_size, Hkv, D].
    """

    attr_name = "self_attn"  # checkpoint prefix inside a decoder layer

    @staticmethod
    def cache_spec(cfg: Qwen3NextConfig, num_speculative_tokens: int) -> PagedKV:
        return PagedKV(cfg.num_key_value_heads, cfg.head_dim)

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads  # Hq
        self.num_kv_heads = cfg.num_key_value_heads  # Hkv
        self.head_dim = cfg.head_dim  # D
        self.scale = self.head_dim**-0.5
        hidden, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(hidden, self.num_heads * d * 2)  # [Hq*2D, H]
        self.k_proj = Linear(hidden, self.num_kv_heads * d)  # [Hkv*D, H]
        self.v_proj = Linear(hidden, self.num_kv_heads * d)  # [Hkv*D, H]
        self.o_proj = Linear(self.num_heads * d, hidden)  # [H, Hq*D]
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)  # weight [D], zero-centred
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)  # weight [D], zero-centred
        self.rotary = PartialRotary(cfg.rotary_dim, cfg.rope_theta)

    def forward(
        self,
        x: torch.Tensor,  # [T, H], already through input_layernorm
        positions: torch.Tensor,  # [T] int64
        ctx: ForwardContext,
        cache_key: int | str,
    ) -> torch.Tensor:  # [T, H]
        num_tokens, d = x.shape[0], self.head_dim
        q_gate = self.q_proj(x).view(num_tokens, self.num_heads, 2 * d)  # [T, Hq, 2D]
        q = q_gate[..., :d]  # [T, Hq, D]
        gate = q_gate[..., d:].reshape(num_tokens, self.num_heads * d)  # [T, Hq*D]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, d)  # [T, Hkv, D]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, d)  # [T, Hkv, D]

        q = self.q_norm(q)
        k = self.k_norm(k)
        q, k = self.rotary(q, k, positions)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()

        o = paged_attend(q, k, v, ctx, cache_key, self.scale)  # [T, Hq, D]
        o = o.reshape(num_tokens, self.num_heads * d) * sigmoid(gate)
        return self.o_proj(o)
