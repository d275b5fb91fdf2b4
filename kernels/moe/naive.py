"""Reference for the MoE ops: softmax top-k routing and the routed SwiGLU experts.

``moe_route``: per token, in float32, ``p = softmax(router_logits)``, the ``top_k`` largest
probabilities and their expert ids (``torch.topk`` order: descending probability), optionally
divided by their sum; the weights come back in ``router_logits.dtype`` (as transformers' router).

``fused_moe``: per token t and slot k, with ``e = topk_ids[t, k]``::

    h = x[t] @ w13[e].T                      # [2I]: [gate | up]
    a = silu(h[:I]) * h[I:]                  # [I]
    y[t, k] = a @ w2[e].T                    # [H]
    out[t] = sum over k = 0, 1, ..., K-1 of topk_weights[t, k] * y[t, k]   (float32, slot order)

Batch invariance: each expert's tokens go through ``naive_linear`` (fixed-size row chunks, so a
row's bits depend only on that row and the weight), and the slot sum runs in a fixed order per
token. A token's output therefore never depends on which other tokens share its experts.
"""

from __future__ import annotations

import torch

from kernels.linear.naive import naive_linear
from kernels.moe.contract import check_fused_moe_inputs, check_moe_route_inputs


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


def naive_fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: rows [gate (I) | up (I)] per expert
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int32/int64, values in [0, E)
) -> torch.Tensor:  # [T, H] in x.dtype
    t, h, _, i, k = check_fused_moe_inputs(x, w13, w2, topk_weights, topk_ids)
    y = x.new_zeros(t, k, h)  # per (token, slot) expert output
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gate_up = naive_linear(x[tok], w13[e])  # [n, 2I]
        act = silu(gate_up[:, :i]) * gate_up[:, i:]  # [n, I]
        y[tok, slot] = naive_linear(act, w2[e])  # [n, H]
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    weights = topk_weights.float()
    for s in range(k):  # fixed slot order
        out += weights[:, s, None] * y[:, s].float()
    return out.to(x.dtype)
