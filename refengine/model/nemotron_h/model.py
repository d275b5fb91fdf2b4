"""The Nemotron-H decoder: one pre-norm block per layer, each holding one mixer chosen by its letter.

``M`` Mamba2 (mamba2.py), ``*`` attention (GQA, no RoPE, no q/k norm, no gate),
``-`` relu² MLP, ``E`` MoE (sigmoid router with a score-correction bias, grouped top-k, routed
scaling, non-gated relu² experts, optional latent projections, a relu² shared expert). Every block is
``x + mixer(norm(x))`` with a plain-weight RMSNorm; then ``norm_f`` and an untied ``lm_head``.

Parameter names follow transformers' in-memory names (``model.embeddings``, ``model.layers.{i}.norm``,
``model.layers.{i}.mixer...``, ``model.norm_f``, ``lm_head``; routed experts stacked as
``mixer.experts.up_proj [E, Ie, Lt]`` and ``mixer.experts.down_proj [E, Lt, Ie]``).
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from refengine.forward_context import AttnMetadata, ForwardContext, RecurrentMetadata
from refengine.model import pieces
from refengine.model.attention import PagedGQA
from refengine.model.cache_specs import MTP_CACHE_KEY, PagedKV
from refengine.model.layers import Linear, RMSNorm
from refengine.model.nemotron_h.config import ATTENTION, MAMBA, MLP, MOE, NemotronHConfig
from refengine.model.nemotron_h.mamba2 import Mamba2Mixer


class Attention(PagedGQA):
    """Plain GQA over the paged KV cache: no positional encoding, scale D^-0.5."""

    @staticmethod
    def cache_spec(cfg: NemotronHConfig, num_speculative_tokens: int) -> PagedKV:
        return PagedKV(cfg.num_key_value_heads, cfg.head_dim)

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)


class ReluSquaredMLP(nn.Module):
    """down(relu²(up(x)))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate_size)  # [I, H]
        self.down_proj = Linear(intermediate_size, hidden_size)  # [H, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(kernels.relu2(self.up_proj(x)))


class Router(nn.Module):
    """Sigmoid router: ``weight [E, H]`` and ``e_score_correction_bias [E]``, both float32 (as transformers
    keeps them); logits are computed in float32."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.renormalize = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(experts, cfg.hidden_size))  # [E, H]
        self.e_score_correction_bias = nn.Parameter(torch.empty(experts))  # [E]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] -> ([T, K] fp32, int32)
        logits = kernels.linear(x.float(), self.weight.float())  # [T, E] float32
        return kernels.moe_route_sigmoid(
            logits, self.e_score_correction_bias, self.top_k, n_group=self.n_group,
            topk_group=self.topk_group, renormalize=self.renormalize, routed_scaling_factor=self.scaling,
        )


class Experts(nn.Module):
    """Non-gated relu² experts, stacked: ``up_proj [E, Ie, Lt]``, ``down_proj [E, Lt, Ie]``."""

    def __init__(self, width: int, num_experts: int, intermediate_size: int) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, width))
        self.down_proj = nn.Parameter(torch.empty(num_experts, width, intermediate_size))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return kernels.fused_moe(x, self.up_proj, self.down_proj, topk_weights, topk_ids,
                                 activation="relu2")  # [T, Lt]


class MoE(nn.Module):
    """Routed experts (on the latent projection of x when the model has one) plus the shared expert on x
    (width Is x n_shared_experts, as vLLM builds it; none when n_shared_experts is 0)."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.gate = Router(cfg)
        self.experts = Experts(cfg.experts_width, cfg.n_routed_experts, cfg.moe_intermediate_size)
        self.shared_experts = (ReluSquaredMLP(hidden, cfg.shared_expert_intermediate_size)
                               if cfg.n_shared_experts else None)
        if cfg.moe_latent_size is not None:
            self.fc1_latent_proj = Linear(hidden, cfg.moe_latent_size)  # [Lt, H]
            self.fc2_latent_proj = Linear(cfg.moe_latent_size, hidden)  # [H, Lt]
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        topk_weights, topk_ids = self.gate(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)  # [T, Lt]
        h = self.experts(h, topk_weights, topk_ids)
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(h)
        return h if self.shared_experts is None else h + self.shared_experts(x)


# block kind -> (mixer class, reads the step's context)
BLOCKS: dict[str, tuple[type, bool]] = {
    MAMBA: (Mamba2Mixer, True),
    ATTENTION: (Attention, True),
    MLP: (ReluSquaredMLP, False),
    MOE: (MoE, False),
}


def _make_mixer(cfg: NemotronHConfig, kind: str) -> nn.Module:
    if kind == MLP:
        return ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size)
    return BLOCKS[kind][0](cfg)


class Block(pieces.StagedLayer):
    """x + mixer(norm(x))."""

    def __init__(self, cfg: NemotronHConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.uses_context = BLOCKS[kind][1]
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, zero_centered=False)  # weight [H]
        self.mixer = _make_mixer(cfg, kind)

    def stages(self, ctx: ForwardContext, cache_key: int | str) -> list[pieces.Stage]:
        """The block over (x, positions): an MLP or MoE block is one pure stage; a Mamba2 or attention
        block's mixer splits around its core."""
        return pieces.mixer_block(self.norm, self.mixer, ctx, cache_key)


class NemotronHModel(nn.Module):
    """Embedding, blocks, final norm (prefix ``model.``)."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        # weight [V, H]; given explicitly so no initialiser runs (the loader assigns real weights).
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                       _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, kind) for kind in cfg.block_kinds)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, zero_centered=False)  # weight [H]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:  # [T] int64 -> [T, H] post norm_f
        return pieces.decoder_stack(self.embeddings, self.layers, self.norm_f, input_ids, positions, ctx)


class MTPBlock(Block):
    """One block of the MTP step: ``x + mixer(norm(x))``. The first block also holds the fusion
    (``enorm``, ``hnorm``, ``eh_proj``), the last one ``final_layernorm``."""

    def __init__(self, cfg: NemotronHConfig, kind: str, first: bool, last: bool) -> None:
        super().__init__(cfg, kind)
        hidden, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        if first:
            self.enorm = RMSNorm(hidden, eps, zero_centered=False)  # weight [H]
            self.hnorm = RMSNorm(hidden, eps, zero_centered=False)  # weight [H]
            self.eh_proj = Linear(2 * hidden, hidden)  # [H, 2H], input is [enorm(embedding) | hnorm(hidden)]
        if last:
            self.final_layernorm = RMSNorm(hidden, eps, zero_centered=False)  # weight [H]


class NemotronHMTPHead(nn.Module):
    """The multi-token-prediction head (prefix ``mtp.``), one step reused for every draft position.

    x = eh_proj(cat([enorm(embed(next token)), hnorm(hidden)])), then the step's blocks (by default
    ``mtp.layers.0`` attention with its own KV cache, ``mtp.layers.1`` MoE), then the last block's
    ``final_layernorm``. Shares the embedding and lm_head with the model.
    """

    def __init__(self, cfg: NemotronHConfig, embeddings: nn.Embedding) -> None:
        super().__init__()
        kinds = cfg.mtp_block_kinds
        self.layers = nn.ModuleList(
            MTPBlock(cfg, kind, first=i == 0, last=i == len(kinds) - 1) for i, kind in enumerate(kinds)
        )
        self._shared = (embeddings,)  # a tuple keeps the shared embedding out of this module's state dict

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, the token after each hidden's position
        hidden: torch.Tensor,  # [T, H], the model's (or the previous MTP step's) hidden, post final norm
        positions: torch.Tensor,  # [T] int64
        attn: AttnMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # k_cache, v_cache [blocks, block_size, Hkv, D]
        step: int = 0,  # draft step; the one MTP step serves every K
        piece_graphs=None,  # a piecewise step's piece graphs, None: eager (``refengine.model.pieces``)
        name: str = "mtp",  # this pass's name among the step's forwards
    ) -> torch.Tensor:  # [T, H] post final_layernorm
        ctx = ForwardContext(attn=attn, recurrent=RecurrentMetadata(), kv_caches={MTP_CACHE_KEY: kv_cache})
        stages = [pieces.pure(self._fuse)]
        for layer in self.layers:
            stages += layer.stages(ctx, MTP_CACHE_KEY)
        stages.append(pieces.pure(self._final_norm))
        return pieces.run(stages, (input_ids, hidden, positions), piece_graphs, name)[0]

    def _fuse(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> pieces.Carry:
        first = self.layers[0]
        e = first.enorm(self._shared[0](input_ids))
        return first.eh_proj(torch.cat([e, first.hnorm(hidden)], dim=-1)), positions

    def _final_norm(self, x: torch.Tensor, positions: torch.Tensor) -> pieces.Carry:
        return (self.layers[-1].final_layernorm(x),)


class NemotronHForCausalLM(nn.Module):
    """Top-level model: ``forward`` returns final-norm hidden states, ``compute_logits`` the logits;
    ``mtp`` is the draft head when the checkpoint holds one (``cfg.num_mtp_layers``), else None."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = NemotronHModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)  # weight [V, H]
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embeddings.weight
        self.mtp = NemotronHMTPHead(cfg, self.model.embeddings) if cfg.num_mtp_layers > 0 else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:  # [T] int64 -> hidden [T, H]
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [M, H] -> [M, V] float32
        return self.lm_head(hidden).float()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embeddings.weight


def cache_specs(cfg: NemotronHConfig, num_speculative_tokens: int,
                drafter_kv: bool = False) -> dict[int | str, object]:
    """Layer index -> its mixer's cache declaration ('-' and 'E' blocks have none), plus the MTP
    step's attention KV cache under ``MTP_CACHE_KEY`` when ``drafter_kv``."""
    out: dict[int | str, object] = {}
    for i, kind in enumerate(cfg.block_kinds):
        mixer, uses_context = BLOCKS[kind]
        if uses_context:
            out[i] = mixer.cache_spec(cfg, num_speculative_tokens)
    if drafter_kv:
        if ATTENTION not in cfg.mtp_block_kinds:
            raise ValueError("a drafter with its own KV cache needs an attention layer in the MTP step; "
                             f"this Nemotron-H head has {cfg.mtp_block_kinds}")
        out[MTP_CACHE_KEY] = Attention.cache_spec(cfg, num_speculative_tokens)
    return out
