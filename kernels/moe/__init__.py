"""MoE: ``moe_route`` (softmax top-k router) and ``fused_moe`` (routed SwiGLU experts), batch-invariant."""

from __future__ import annotations

import torch

from kernels._dispatch import resolve_backend
from kernels.moe.naive import naive_fused_moe, naive_moe_route


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``(topk_weights [T, K] in router_logits.dtype, topk_ids [T, K] int32)``.

    Softmax in float32, ``torch.topk`` (descending), optional renormalisation to sum 1. Row-wise
    torch ops on any device: a token's routing depends on its own logits only.
    """
    return naive_moe_route(router_logits, top_k, renormalize)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``x [T, H]``, ``w13 [E, 2I, H]`` ([gate | up] rows), ``w2 [E, H, I]``, ``topk_* [T, K]`` -> ``[T, H]``.

    ``out[t] = sum_k topk_weights[t, k] * (silu(x[t] @ gate_e.T) * (x[t] @ up_e.T)) @ w2[e].T`` with
    ``e = topk_ids[t, k]``, the slot sum in float32 in slot order; result in ``x.dtype``. A token's
    result is bitwise identical whatever other tokens share the call or its experts.
    """
    if resolve_backend(backend, x, w13, w2) == "torch":
        return naive_fused_moe(x, w13, w2, topk_weights, topk_ids)
    from kernels.moe.triton_moe import triton_fused_moe

    return triton_fused_moe(x, w13, w2, topk_weights, topk_ids)


__all__ = ["fused_moe", "moe_route", "naive_fused_moe", "naive_moe_route"]
