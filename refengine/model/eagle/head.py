"""EAGLE-1 and EAGLE-3 draft heads, computing what vLLM 0.33's ``llama_eagle.py`` / ``llama_eagle3.py`` do.

Both are Llama decoder layers (plain-weight RMSNorm, full NeoX RoPE, GQA, SwiGLU) with a KV cache of their
own (``ForwardContext.kv_caches["eagle.{i}"]``, one per head layer). Every head has the same call:

- ``first_hidden(target_hidden, aux)``: the hidden state the first pass is fed: EAGLE-1 the target's final
  (normed) hidden state [T, H]; EAGLE-3 ``fc`` over the concatenated auxiliary states [T, n*Ht];
- ``forward(ids, hidden, positions, attn, kv_caches)`` -> (for the logits, for the next chained step), each
  [T, H]; the chain feeds the second back as ``hidden``;
- ``draft(h)`` -> [T] target token ids, the greedy draft from the first output.

EAGLE-1: x = fc(cat(embed(ids), hidden)); layers, the first without an input norm; returns ``h + residual``
twice (no final norm); logits from the target's lm_head.
EAGLE-3: layer 0 attends over cat(input_layernorm(embed(ids)), hidden_norm(hidden)) (q/k/v take 2H), with
residual the un-normed hidden (the normed one with ``norm_before_residual``); ``norm`` over h + residual
gives the logits' input, h + residual itself feeds the chain; lm_head over the draft vocabulary, and
target id = draft id + d2t[draft id].
"""

from __future__ import annotations

import torch
from torch import nn

from refengine.forward_context import AttnMetadata, ForwardContext, RecurrentMetadata
from refengine.model.attention import PagedGQA
from refengine.model.cache_specs import PagedKV
from refengine.model.eagle.config import EAGLE3, EagleHeadConfig
from refengine.model.layers import MLP, Linear, PartialRotary, RMSNorm

CACHE_PREFIX = "eagle."  # the head's KV caches: "eagle.0", "eagle.1", ... (one per head layer)


def cache_key(layer: int) -> str:
    return f"{CACHE_PREFIX}{layer}"


def head_cache_specs(cfg: EagleHeadConfig) -> dict[str, PagedKV]:
    return {cache_key(i): PagedKV(cfg.num_key_value_heads, cfg.head_dim)
            for i in range(cfg.num_hidden_layers)}


class EagleLayer(nn.Module):
    """A Llama decoder layer; ``input_layernorm`` is None in EAGLE-1's first layer (vLLM's identity)."""

    def __init__(self, cfg: EagleHeadConfig, in_width: int, input_norm: bool, hidden_norm: bool) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, zero_centered=False) if input_norm else None  # weight [H]
        self.hidden_norm = RMSNorm(h, eps, zero_centered=False) if hidden_norm else None  # weight [H]
        # GQA with full NeoX RoPE; q/k/v read ``in_width`` inputs (2H in EAGLE-3)
        self.self_attn = PagedGQA(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                  in_width=in_width, rotary=PartialRotary(cfg.head_dim, cfg.rope_theta))
        self.post_attention_layernorm = RMSNorm(h, eps, zero_centered=False)  # weight [H]
        self.mlp = MLP(h, cfg.intermediate_size)

    def post_attention(self, a: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's fused add + norm, then the MLP: returns (mlp output, the new residual), each [T, H]."""
        residual = a + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


def _context(attn: AttnMetadata, kv_caches: dict) -> ForwardContext:
    return ForwardContext(attn=attn, recurrent=RecurrentMetadata(), kv_caches=kv_caches)


class Eagle1Head(nn.Module):
    """vLLM's ``EagleLlamaForCausalLM``: ``fc`` [H, 2H], ``layers.{i}``; embedding and lm_head shared with
    the target unless the head ships ``embed_tokens``."""

    def __init__(self, cfg: EagleHeadConfig, embed: nn.Module, logits) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h)  # [H, 2H], input [embedding | hidden]
        self.layers = nn.ModuleList(EagleLayer(cfg, h, input_norm=i > 0, hidden_norm=False)
                                    for i in range(cfg.num_hidden_layers))
        self.embed_tokens: nn.Embedding | None = None  # set by the loader when the head ships its own
        self._shared = (embed, logits)  # a tuple keeps the target's modules out of this one's parameters

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, H]
        return (self.embed_tokens or self._shared[0])(ids)

    def first_hidden(self, target_hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        return target_hidden  # [T, H] the target's final (normed) hidden state

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attn: AttnMetadata,
                kv_caches: dict) -> tuple[torch.Tensor, torch.Tensor]:  # ids, positions [T]; hidden [T, H]
        ctx = _context(attn, kv_caches)
        x = self.fc(torch.cat([self.embed(ids), hidden], dim=-1))
        residual = x
        for i, layer in enumerate(self.layers):
            if i > 0:  # the fused add + norm of the layers after the first
                residual = x + residual
                x = layer.input_layernorm(residual)
            a = layer.self_attn(x, positions, ctx, cache_key(i))
            x, residual = layer.post_attention(a, residual)
        out = x + residual
        return out, out

    def draft(self, h: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M] int64 target ids
        return self._shared[1](h).argmax(dim=-1)


class Eagle3Head(nn.Module):
    """vLLM's ``Eagle3LlamaForCausalLM``: ``fc`` [H, n*Ht], ``midlayer`` (stored as ``layers.0``), ``norm``,
    ``lm_head`` [Vd, H], ``d2t`` [Vd] offsets (None when the draft vocabulary is the target's)."""

    def __init__(self, cfg: EagleHeadConfig, embed: nn.Module, num_aux: int) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = Linear(num_aux * cfg.target_hidden_size, h)  # [H, n*Ht]
        self.layers = nn.ModuleList([EagleLayer(cfg, 2 * h, input_norm=True, hidden_norm=True)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, zero_centered=False)  # weight [H]
        self.lm_head = Linear(h, cfg.draft_vocab_size)  # weight [Vd, H]
        self.d2t: torch.Tensor | None = None  # [Vd] int64 offsets, set by the loader (a buffer)
        self.embed_tokens: nn.Embedding | None = None  # set by the loader when the head ships its own
        self._shared = (embed,)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, H]
        return (self.embed_tokens or self._shared[0])(ids)

    def first_hidden(self, target_hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        if aux is None:
            raise ValueError("an EAGLE-3 head needs the target's auxiliary hidden states")
        return self.fc(aux)  # [T, n*Ht] -> [T, H]

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attn: AttnMetadata,
                kv_caches: dict) -> tuple[torch.Tensor, torch.Tensor]:  # ids, positions [T]; hidden [T, H]
        ctx = _context(attn, kv_caches)
        layer = self.layers[0]
        e = layer.input_layernorm(self.embed(ids))
        hn = layer.hidden_norm(hidden)
        residual = hn if self.config.norm_before_residual else hidden
        a = layer.self_attn(torch.cat([e, hn], dim=-1), positions, ctx, cache_key(0))
        x, residual = layer.post_attention(a, residual)
        prenorm = x + residual
        return self.norm(prenorm), prenorm

    def draft(self, h: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M] int64 target ids
        ids = self.lm_head(h).float().argmax(dim=-1)
        return ids if self.d2t is None else ids + self.d2t[ids]


def make_head(cfg: EagleHeadConfig, embed: nn.Module, logits, num_aux: int) -> nn.Module:
    return Eagle3Head(cfg, embed, num_aux) if cfg.method == EAGLE3 else Eagle1Head(cfg, embed, logits)
