"""The hybrid decoder (GDN + gated attention layers), its lm_head and the MTP draft head.

Parameter names follow the HF checkpoint keys (after the GDN layout is normalised to the Qwen3.5
split form), so ``state_dict()`` keys are ``model.layers.{i}...``, ``lm_head.weight``, ``mtp...``.
"""

from __future__ import annotations

import torch
from torch import nn

from refengine.forward_context import AttnMetadata, ForwardContext, RecurrentMetadata
from refengine.model import pieces
from refengine.model.cache_specs import MTP_CACHE_KEY, PagedKV, RecurrentState
from refengine.model.layers import Linear, RMSNorm
from refengine.model.qwen3_next.config import FULL, Qwen3NextConfig
from refengine.model.qwen3_next.mixers import mixer_class
from refengine.model.qwen3_next.moe import make_mlp


class DecoderLayer(pieces.StagedLayer):
    """Pre-norm residual block: x + mixer(input_layernorm(x)), then x + mlp(post_attention_layernorm(x))."""

    def __init__(self, cfg: Qwen3NextConfig, layer_type: str, layer_index: int) -> None:
        super().__init__()
        self.layer_type = layer_type
        mixer = mixer_class(layer_type)
        self.mixer_name = mixer.attr_name  # "linear_attn" | "self_attn", as in the checkpoint
        self.add_module(self.mixer_name, mixer(cfg))
        self.mlp = make_mlp(cfg, layer_index)  # dense SwiGLU or sparse MoE, by transformers' rule
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # weight [H]
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # weight [H]

    def stages(self, ctx: ForwardContext, cache_key: int | str) -> list[pieces.Stage]:
        """The block over (x, positions): the mixer's token-wise parts and the MLP are pure stages."""
        return pieces.mixer_block(self.input_layernorm, getattr(self, self.mixer_name), ctx, cache_key,
                                  tail=self._mlp_residual)

    def _mlp_residual(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextModel(nn.Module):
    """Embedding, decoder layers, final norm (HF prefix ``model.``)."""

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        # weight [V, H]; given explicitly so no initialiser runs (the loader assigns real weights).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, kind, i) for i, kind in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # weight [H]

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # input_ids, positions [T] int64 -> [T, H] post final norm
        return pieces.decoder_stack(self.embed_tokens, self.layers, self.norm, input_ids, positions, ctx)


class Qwen3NextMTPHead(nn.Module):
    """Multi-token-prediction draft head (prefix ``mtp.``); shares embedding and lm_head with the model.

    e = pre_fc_norm_embedding(embed(ids)), h = pre_fc_norm_hidden(hidden), x = fc(cat([e, h])),
    then one full-attention decoder layer with its own KV cache, then mtp.norm.
    """

    def __init__(self, cfg: Qwen3NextConfig, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.fc = Linear(2 * hidden, hidden)  # [H, 2H], input is [embedding | hidden]
        self.pre_fc_norm_embedding = RMSNorm(hidden, cfg.rms_norm_eps)  # weight [H]
        self.pre_fc_norm_hidden = RMSNorm(hidden, cfg.rms_norm_eps)  # weight [H]
        self.layers = nn.ModuleList(DecoderLayer(cfg, FULL, i) for i in range(cfg.num_mtp_layers))
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)  # weight [H]
        # A tuple keeps the shared embedding out of this module's parameters and state dict.
        self._shared = (embed_tokens,)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, the token after each hidden's position
        hidden: torch.Tensor,  # [T, H], main-model (or previous MTP step) hidden, post final norm
        positions: torch.Tensor,  # [T] int64
        attn: AttnMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # k_cache, v_cache [blocks, block_size, Hkv, D]
        step: int = 0,  # draft step; picks mtp.layers[step % num_mtp_layers]
        piece_graphs=None,  # a piecewise step's piece graphs, None: eager (``refengine.model.pieces``)
        name: str = "mtp",  # this pass's name among the step's forwards
    ) -> torch.Tensor:  # [T, H] post mtp.norm
        ctx = ForwardContext(attn=attn, recurrent=RecurrentMetadata(), kv_caches={MTP_CACHE_KEY: kv_cache})
        layer = self.layers[step % len(self.layers)]
        stages = [pieces.pure(self._fuse), *layer.stages(ctx, MTP_CACHE_KEY), pieces.pure(self._final_norm)]
        return pieces.run(stages, (input_ids, hidden, positions), piece_graphs, name)[0]

    def _fuse(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> pieces.Carry:
        e = self.pre_fc_norm_embedding(self._shared[0](input_ids))
        h = self.pre_fc_norm_hidden(hidden)
        return self.fc(torch.cat([e, h], dim=-1)), positions

    def _final_norm(self, x: torch.Tensor, positions: torch.Tensor) -> pieces.Carry:
        return (self.norm(x),)


class Qwen3NextForCausalLM(nn.Module):
    """Top-level model: ``forward`` returns final-norm hidden states, ``compute_logits`` the logits."""

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3NextModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)  # weight [V, H]
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = Qwen3NextMTPHead(cfg, self.model.embed_tokens) if cfg.num_mtp_layers > 0 else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:  # input_ids, positions [T] int64 -> hidden [T, H] (post final norm)
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M, V] float32
        return self.lm_head(hidden).float()

    def tie_weights(self) -> None:
        """Re-share lm_head with the embedding (after weights were assigned) when tied."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def cache_specs(cfg: Qwen3NextConfig, num_speculative_tokens: int,
                drafter_kv: bool) -> dict[int | str, PagedKV | RecurrentState]:
    """Layer index -> its mixer's cache declaration (every layer has one), plus the MTP layer's KV cache
    under ``MTP_CACHE_KEY`` when ``drafter_kv``."""
    specs: dict[int | str, PagedKV | RecurrentState] = {
        i: mixer_class(kind).cache_spec(cfg, num_speculative_tokens) for i, kind in enumerate(cfg.layer_types)
    }
    if drafter_kv:  # the MTP layer is a full-attention layer with its own KV cache
        specs[MTP_CACHE_KEY] = mixer_class(FULL).cache_spec(cfg, num_speculative_tokens)
    return specs
