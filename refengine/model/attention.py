"""Full attention over the paged KV cache: ``paged_attend`` (every attention mixer's cache step),
``PagedGQA`` (plain grouped-query attention, with RoPE and per-head q/k norms where a model has them) and
``GatedAttention`` (q/k RMSNorm, partial NeoX RoPE, sigmoid output gate)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

import kernels
from refengine.forward_context import ForwardContext
from refengine.model.cache_specs import PagedKV
from refengine.model.layers import Linear, PartialRotary, RMSNorm, sigmoid
from refengine.model.pieces import SplitMixer

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


class PagedGQA(SplitMixer):
    """Grouped-query attention: q/k/v projections (no bias) from ``in_width`` inputs, optional per-head q/k
    RMSNorm, optional RoPE (``rotary(q, k, positions)``), paged attention at scale D^-0.5, ``o_proj`` back
    to ``hidden``. Parameter names are the checkpoints' (``q_proj`` ... ``o_proj``, ``q_norm``, ``k_norm``).

    Cache: ``ctx.kv_caches[cache_key] = (k_cache, v_cache)``, each [blocks, block_size, Hkv, D].
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 in_width: int | None = None, rotary: nn.Module | None = None,
                 qk_norm_eps: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim  # Hq, Hkv, D
        self.scale = head_dim**-0.5
        d, width = head_dim, hidden if in_width is None else in_width
        self.q_proj = Linear(width, num_heads * d)  # [Hq*D, in]
        self.k_proj = Linear(width, num_kv_heads * d)  # [Hkv*D, in]
        self.v_proj = Linear(width, num_kv_heads * d)  # [Hkv*D, in]
        self.o_proj = Linear(num_heads * d, hidden)  # [H, Hq*D]
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(d, qk_norm_eps, zero_centered=False)  # weight [D]
            self.k_norm = RMSNorm(d, qk_norm_eps, zero_centered=False)  # weight [D]
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary

    def pre(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Token-wise: q [T, Hq, D], k, v [T, Hkv, D], contiguous, q/k normed and rotated."""
        num_tokens, d = x.shape[0], self.head_dim
        q = self.q_proj(x).view(num_tokens, self.num_heads, d)  # [T, Hq, D]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, d)  # [T, Hkv, D]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, d)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q, k, positions)
        return q.contiguous(), k.contiguous(), v.contiguous()

    def core(self, parts: tuple, positions: torch.Tensor, ctx: ForwardContext,
             cache_key: int | str) -> tuple[torch.Tensor]:
        q, k, v = parts
        return (paged_attend(q, k, v, ctx, cache_key, self.scale),)  # [T, Hq, D]

    def post(self, q, k, v, o) -> torch.Tensor:  # o [T, Hq, D] -> [T, H]
        return self.o_proj(o.reshape(o.shape[0], self.num_heads * self.head_dim))


class GatedAttention(SplitMixer):
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

    def pre(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Token-wise: q [T, Hq, D], k, v [T, Hkv, D] (contiguous, q/k normed and rotated), gate [T, Hq*D]."""
        num_tokens, d = x.shape[0], self.head_dim
        q_gate = self.q_proj(x).view(num_tokens, self.num_heads, 2 * d)  # [T, Hq, 2D]
        q = q_gate[..., :d]  # [T, Hq, D]
        gate = q_gate[..., d:].reshape(num_tokens, self.num_heads * d)  # [T, Hq*D]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, d)  # [T, Hkv, D]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, d)  # [T, Hkv, D]
        q = self.q_norm(q)
        k = self.k_norm(k)
        q, k = self.rotary(q, k, positions)
        return q.contiguous(), k.contiguous(), v.contiguous(), gate

    def core(self, parts: tuple, positions: torch.Tensor, ctx: ForwardContext,
             cache_key: int | str) -> tuple[torch.Tensor]:
        q, k, v, _ = parts
        return (paged_attend(q, k, v, ctx, cache_key, self.scale),)  # [T, Hq, D]

    def post(self, q, k, v, gate, o) -> torch.Tensor:  # gate [T, Hq*D], o [T, Hq, D] -> [T, H]
        o = o.reshape(o.shape[0], self.num_heads * self.head_dim) * sigmoid(gate)
        return self.o_proj(o)
