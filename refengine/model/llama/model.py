"""The dense decoder of Llama and Qwen3: pre-norm blocks of GQA attention over the paged KV cache and a
SwiGLU MLP, then a final RMSNorm and the lm_head (tied to the embedding or not).

Every block is ``x + attn(input_layernorm(x))`` then ``x + mlp(post_attention_layernorm(x))``, RMSNorms
with plain weights. Attention is NeoX-style RoPE on the whole head (Llama-3.1's ``llama3`` frequency
scaling when the config has it), scale D^-0.5; Qwen3 first RMS-normalises each q and k head.

Parameter names are transformers' (``model.embed_tokens``, ``model.layers.{i}.self_attn.q_proj``, ...,
``model.norm``, ``lm_head``), which are also the checkpoint's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from refengine.forward_context import ForwardContext
from refengine.model import pieces
from refengine.model.attention import PagedGQA
from refengine.model.cache_specs import PagedKV
from refengine.model.layers import MLP, Linear, PartialRotary, RMSNorm
from refengine.model.llama.config import Llama3Scaling, LlamaConfig


class Rotary(PartialRotary):
    """RoPE on the whole head, its inverse frequencies scaled as Llama-3.1 does when ``scaling`` is given.

    Holds no tensors: the frequencies are recomputed in float32 on the positions' device, with the same
    float32 operations as transformers' ``llama3`` initialiser, so they equal its bit for bit on the CPU.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Llama3Scaling | None) -> None:
        super().__init__(head_dim, theta)
        self.scaling = scaling
        self.plain = scaling is None  # unscaled: the frequencies of ``kernels.rotary_embedding``

    def inv_freq(self, device: torch.device) -> torch.Tensor:  # [D/2] float32
        rd = self.rotary_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, rd, 2, dtype=torch.float32, device=device) / rd))
        s = self.scaling
        if s is None:
            return inv_freq
        old_len = s.original_max_position_embeddings
        low_freq_wavelen = old_len / s.low_freq_factor
        high_freq_wavelen = old_len / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq  # [D/2]
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)  # long: slowed
        smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, D] float32."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq(positions.device)[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos(), emb.sin()


class Attention(PagedGQA):
    """GQA with RoPE (llama3-scaled where the config says) and Qwen3's per-head q/k norms."""

    @staticmethod
    def cache_spec(cfg: LlamaConfig, num_speculative_tokens: int) -> PagedKV:
        return PagedKV(cfg.num_key_value_heads, cfg.head_dim)

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         rotary=Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                         qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None)


class DecoderLayer(pieces.StagedLayer):
    """x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)  # weight [H]
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                zero_centered=False)  # weight [H]

    def stages(self, ctx: ForwardContext, cache_key: int | str) -> list[pieces.Stage]:
        """The block over (x, positions): the attention's token-wise parts and the MLP are pure stages."""
        return pieces.mixer_block(self.input_layernorm, self.self_attn, ctx, cache_key,
                                  tail=self._mlp_residual)

    def _mlp_residual(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (prefix ``model.``)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        # weight [V, H]; given explicitly so no initialiser runs (the loader assigns real weights).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=False)  # weight [H]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:  # input_ids, positions [T] int64 -> [T, H] post norm
        return pieces.decoder_stack(self.embed_tokens, self.layers, self.norm, input_ids, positions, ctx)


class LlamaForCausalLM(nn.Module):
    """Top-level model: ``forward`` returns final-norm hidden states, ``compute_logits`` the logits; no
    draft head (``mtp`` is None)."""

    mtp = None

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)  # weight [V, H]
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:  # [T] int64 -> hidden [T, H] (post final norm)
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M, V] float32
        return self.lm_head(hidden).float()

    def tie_weights(self) -> None:
        """Re-share lm_head with the embedding (after weights were assigned) when tied."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def cache_specs(cfg: LlamaConfig, num_speculative_tokens: int,
                drafter_kv: bool = False) -> dict[int | str, PagedKV]:
    """One paged KV cache per layer. The model has no draft head, so it has no drafter KV cache to give."""
    if drafter_kv:
        raise ValueError(f"a {cfg.model_type} model has no MTP head, so no drafter KV cache of its own")
    return {i: Attention.cache_spec(cfg, num_speculative_tokens) for i in range(cfg.num_hidden_layers)}
