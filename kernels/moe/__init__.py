"""MoE: ``moe_route`` (softmax top-k router), ``moe_route_sigmoid`` (biased sigmoid, grouped top-k) and
``fused_moe`` (routed SwiGLU or relu² experts), batch-invariant."""

from __future__ import annotations

import torch

from kernels._dispatch import resolve_backend
from kernels.moe.naive import naive_fused_moe, naive_moe_route, naive_moe_route_sigmoid


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``(topk_weights [T, K] in router_logits.dtype, topk_ids [T, K] int32)``.

    Softmax in float32, ``torch.topk`` (descending), optional renormalisation to sum 1. Row-wise
    torch ops on any device: a token's routing depends on its own logits only.
    """
    return naive_moe_route(router_logits, top_k, renormalize)


def moe_route_sigmoid(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nemotron-H's router: ``router_logits [T, E]``, ``correction_bias [E]`` (the checkpoint's
    ``e_score_correction_bias``) -> ``(topk_weights [T, K] float32, topk_ids [T, K] int32)``.

    In float32 per token: ``s = sigmoid(logits)``; experts are *chosen* on ``s + correction_bias``
    (with ``n_group > 1``: only the experts of the ``topk_group`` groups whose two best biased
    scores sum highest), the ``top_k`` best in descending order; the *weights* are the unbiased ``s``
    of the chosen experts, divided by ``sum + 1e-20`` when ``renormalize`` (``norm_topk_prob``), times
    ``routed_scaling_factor``. Row-wise torch ops on any device.
    """
    return naive_moe_route_sigmoid(router_logits, correction_bias, top_k, n_group=n_group,
                                   topk_group=topk_group, renormalize=renormalize,
                                   routed_scaling_factor=routed_scaling_factor)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    backend: str | None = None,
) -> torch.Tensor:
    """``x [T, H]``, ``w13``, ``w2 [E, H, I]``, ``topk_* [T, K]`` -> ``[T, H]``.

    ``activation="silu"`` (SwiGLU): ``w13 [E, 2I, H]`` ([gate | up] rows) and
    ``y[t, k] = (silu(x[t] @ gate_e.T) * (x[t] @ up_e.T)) @ w2[e].T``.
    ``activation="relu2"`` (Nemotron-H, non-gated): ``w13 [E, I, H]`` is the up projection and
    ``y[t, k] = relu(x[t] @ up_e.T)^2 @ w2[e].T``.
    ``out[t] = sum_k topk_weights[t, k] * y[t, k]`` with ``e = topk_ids[t, k]``, the slot sum in
    float32 in slot order; result in ``x.dtype``. A token's result is bitwise identical whatever
    other tokens share the call or its experts.
    """
    if resolve_backend(backend, x, w13, w2) == "torch":
        return naive_fused_moe(x, w13, w2, topk_weights, topk_ids, activation)
    from kernels.moe.triton_moe import triton_fused_moe

    return triton_fused_moe(x, w13, w2, topk_weights, topk_ids, activation)


__all__ = [
    "fused_moe",
    "moe_route",
    "moe_route_sigmoid",
    "naive_fused_moe",
    "naive_moe_route",
    "naive_moe_route_sigmoid",
]
