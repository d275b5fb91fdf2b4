"""Sparse mixture-of-experts MLP of Qwen3-Next and Qwen3.5-MoE, and the per-layer dense/MoE choice.

Per token x [H] (transformers' Qwen3NextSparseMoeBlock / Qwen3_5MoeSparseMoeBlock):

    p = softmax(x @ gate.T) in float32                    # [E]
    w, ids = top-k of p (K experts), w /= sum(w) when norm_topk_prob
    routed = sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)),  e = ids_k
    shared = sigmoid(x @ shared_expert_gate.T) * shared_expert(x)
    out = routed + shared

Parameters follow transformers' module names; the routed experts are stored fused, as transformers
holds them in memory: ``experts.gate_up_proj [E, 2Ie, H]`` (rows [gate | up] per expert) and
``experts.down_proj [E, H, Ie]``. The loader accepts both the per-expert tensors transformers
writes (``experts.{e}.gate_proj.weight`` ...) and the fused ones.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from refengine.model.layers import MLP, Linear, sigmoid
from refengine.model.qwen3_next.config import Qwen3NextConfig


class Router(nn.Module):
    """``weight [E, H]``: router logits ``x @ weight.T``, then softmax top-k (``kernels.moe_route``)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))  # [E, H]

    def forward(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] -> ([T, K], [T, K] int32)
        logits = kernels.linear(x, self.weight)  # [T, E] in x.dtype, as transformers' F.linear
        return kernels.moe_route(logits, self.top_k, self.renormalize)


class Experts(nn.Module):
    """The routed SwiGLU experts, fused: ``gate_up_proj [E, 2Ie, H]``, ``down_proj [E, H, Ie]``."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:  # x [T, H], topk_* [T, K] -> [T, H]
        return kernels.fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """Routed experts plus the sigmoid-gated shared expert (prefix ``mlp.``)."""

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.gate = Router(hidden, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.experts = Experts(hidden, cfg.num_experts, cfg.moe_intermediate_size)
        self.shared_expert = MLP(hidden, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = Linear(hidden, 1)  # [1, H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H] -> [T, H]
        topk_weights, topk_ids = self.gate(x)
        routed = self.experts(x, topk_weights, topk_ids)
        shared = sigmoid(self._shared_gate_logit(x)) * self.shared_expert(x)
        return routed + shared

    def _shared_gate_logit(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, 1]
        # A one-row weight would send the reference linear down BLAS's matrix-vector path, whose
        # bits depend on the row count; a second, zero row keeps the fixed-shape GEMM.
        w = self.shared_expert_gate.weight  # [1, H]
        return kernels.linear(x, torch.cat([w, torch.zeros_like(w)]))[:, :1]


def make_mlp(cfg: Qwen3NextConfig, layer_index: int) -> nn.Module:
    """The MLP of decoder layer ``layer_index`` (or MTP layer ``layer_index``): MoE or dense SwiGLU."""
    if cfg.is_moe_layer(layer_index):
        return SparseMoeBlock(cfg)
    return MLP(cfg.hidden_size, cfg.intermediate_size)
