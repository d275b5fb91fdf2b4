"""Reference for the MoE ops: softmax / sigmoid top-k routing and the routed experts (SwiGLU or relu²).

``moe_route``: per token, in float32, ``p = softmax(router_logits)``, the ``top_k`` largest
probabilities and their expert ids (``torch.topk`` order: descending probability), optionally
divided by their sum; the weights come back in ``router_logits.dtype`` (as transformers' router).

``fused_moe``: per token t and slot k, with ``e = topk_ids[t, k]``::

    h = x[t] @ w13[e].T                      # [2I]: [gate | up]
    a = silu(h[:I]) * h[I:]                  # [I]
    y[t, k] = a @ w2[e].T                    # [H]
    out[t] = sum over k = 0, 1, ..., K-1 of topk_weights[t, k] * y[t, k]   (float32, slot order)

``moe_route_sigmoid`` (Nemotron-H, DeepSeek-V3), per token in float32: ``s = sigmoid(logits)``;
experts are chosen on ``s + correction_bias``: with ``n_group > 1`` each group of ``E / n_group``
experts scores the sum of its two best biased scores, the best ``topk_group`` groups stay and the
others' experts are masked out; then the ``top_k`` best biased scores (``torch.topk`` order). The
weights are the *unbiased* ``s`` of the chosen experts, divided by ``sum + 1e-20`` when
``renormalize``, times ``routed_scaling_factor``; float32.

``fused_moe(..., activation="relu2")`` (Nemotron-H's non-gated experts): ``w13 [E, I, H]`` holds the
up projection only and ``y[t, k] = relu(x[t] @ w13[e].T)^2 @ w2[e].T`` (up and relu² rounded to
``x.dtype`` in turn); the slot sum is the same.

Batch invariance: each expert's tokens go through ``naive_linear`` (fixed-size row chunks, so a
row's bits depend only on that row and the weight), and the slot sum runs in a fixed order per
token. A token's output therefore never depends on which other tokens share its experts.
"""

from __future__ import annotations

import torch

from kernels.linear.naive import naive_linear
from kernels.moe.contract import (
    check_fused_moe_inputs,
    check_moe_route_inputs,
    check_moe_route_sigmoid_inputs,
)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) in float32, returned in x.dtype (exp only: the same bits wherever x sits)."""
    x32 = x.float()
    return (x32 / (1.0 + torch.exp(-x32))).to(x.dtype)


def naive_moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``topk_weights [T, K]`` (router_logits.dtype),
    ``topk_ids [T, K]`` int32."""
    check_moe_route_inputs(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E] float32
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids.to(torch.int32)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 squared in float32, returned in x.dtype (one rounding, as a 16-bit torch square)."""
    r = torch.clamp_min(x.float(), 0.0)
    return (r * r).to(x.dtype)


def naive_moe_route_sigmoid(
    router_logits: torch.Tensor,  # [T, E]
    correction_bias: torch.Tensor,  # [E]
    top_k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, K] float32, [T, K] int32)
    """Nemotron-H / DeepSeek-V3 routing, in float32 per token (see the module docstring of moe/)."""
    num_tokens, num_experts = check_moe_route_sigmoid_inputs(
        router_logits, correction_bias, top_k, n_group, topk_group, renormalize, routed_scaling_factor)
    # 1 / (1 + exp(-x)): torch.sigmoid on CPU rounds a tensor's vectorised body and its scalar tail
    # differently, so a token's routing weights would depend on how many tokens share the call.
    scores = 1.0 / (1.0 + torch.exp(-router_logits.float()))  # [T, E]
    choice = scores + correction_bias.float()[None, :]  # [T, E], selection only
    per_group = num_experts // n_group
    if n_group > 1:
        grouped = choice.view(num_tokens, n_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1)[0].sum(dim=-1)  # [T, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, torch.topk(group_scores, topk_group, dim=-1)[1], True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1)[1]  # [T, K], descending biased score
    weights = scores.gather(1, ids)  # the unbiased sigmoid
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def naive_fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: rows [gate (I) | up (I)] per expert; [E, I, H] (up) for relu2
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int32/int64, values in [0, E)
    activation: str = "silu",
) -> torch.Tensor:  # [T, H] in x.dtype
    t, h, _, i, k = check_fused_moe_inputs(x, w13, w2, topk_weights, topk_ids, activation)
    y = x.new_zeros(t, k, h)  # per (token, slot) expert output
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if activation == "relu2":
            act = relu2(naive_linear(x[tok], w13[e]))  # [n, I]
        else:
            gate_up = naive_linear(x[tok], w13[e])  # [n, 2I]
            act = silu(gate_up[:, :i]) * gate_up[:, i:]  # [n, I]
        y[tok, slot] = naive_linear(act, w2[e])  # [n, H]
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    weights = topk_weights.float()
    for s in range(k):  # fixed slot order
        out += weights[:, s, None] * y[:, s].float()
    return out.to(x.dtype)
