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


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) in float32, returned in x.dtype (exp only: the same bits wherever x sits)."""
    x32 = x.float()
    return (x32 / (1.0 + torch.exp(-x32))).to(x.dtype)


def naive_moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``topk_weights [T, K]`` (router_logits.dtype), ``topk_ids [T, K]`` int32."""
    assert router_logits.dim() == 2, "moe_route: router_logits must be [T, E]"
    assert 1 <= top_k <= router_logits.shape[1], f"moe_route: top_k {top_k} not in [1, {router_logits.shape[1]}]"
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E] float32
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids.to(torch.int32)


def check_moe_args(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> tuple[int, int, int, int, int]:
    """Assert the shapes and dtypes shared by both backends; returns (T, H, E, I, K)."""
    assert x.dim() == 2, "fused_moe: x must be [T, H]"
    assert w13.dim() == 3 and w2.dim() == 3, "fused_moe: w13 [E, 2I, H] and w2 [E, H, I]"
    t, h = x.shape
    e, two_i, h13 = w13.shape
    assert h13 == h and two_i % 2 == 0, f"fused_moe: w13 {tuple(w13.shape)} does not fit hidden {h}"
    i = two_i // 2
    assert tuple(w2.shape) == (e, h, i), f"fused_moe: w2 {tuple(w2.shape)}, expected {(e, h, i)}"
    assert x.dtype == w13.dtype == w2.dtype, f"fused_moe: dtypes differ: x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == t, "fused_moe: topk_ids must be [T, K]"
    assert topk_ids.dtype in (torch.int32, torch.int64), f"fused_moe: topk_ids dtype {topk_ids.dtype}"
    assert topk_weights.shape == topk_ids.shape, "fused_moe: topk_weights and topk_ids must both be [T, K]"
    assert topk_weights.is_floating_point(), "fused_moe: topk_weights must be floating point"
    return t, h, e, i, topk_ids.shape[1]


def naive_fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: rows [gate (I) | up (I)] per expert
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int32/int64, values in [0, E)
) -> torch.Tensor:  # [T, H] in x.dtype
    t, h, _, i, k = check_moe_args(x, w13, w2, topk_weights, topk_ids)
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
