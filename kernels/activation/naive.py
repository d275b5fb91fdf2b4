"""References for ``relu2`` and ``silu_mul``.

``relu2``: ``relu(x) ** 2``, squared in float32 and rounded once to ``x.dtype``.

A 16-bit square computed by torch (float32 arithmetic, one rounding) gives the same bits, so this
equals transformers' ``square(relu(x))`` in every dtype.

``silu_mul``: SwiGLU's ``silu(gate) * up``, the silu computed in float32 as ``g / (1 + exp(-g))`` (the
same bits wherever an element sits: ``torch.sigmoid`` on CPU treats a tensor's tail elements on another
code path) and rounded to the inputs' dtype, then multiplied by ``up`` (a 16-bit torch product: float32
arithmetic, one rounding).

``softplus_fp32`` and ``sigmoid_fp32``: the float32 helpers the references and the models share, written
with ``exp`` / ``log1p`` and exact arithmetic (``F.softplus`` and ``torch.sigmoid`` on CPU treat a tensor's
tail elements on another code path).
"""

from __future__ import annotations

import torch

from kernels.activation.contract import check_relu2_inputs, check_silu_mul_inputs

SOFTPLUS_THRESHOLD = 20.0  # as torch.nn.functional.softplus: identity above it


def softplus_fp32(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)) (x itself above the threshold), for float32 x."""
    return torch.where(
        x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(torch.clamp(x, max=SOFTPLUS_THRESHOLD)))
    )


def sigmoid_fp32(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) for float32 x. ``1.0 / y`` is torch's ``y.reciprocal() * 1.0``: the reciprocal alone
    has its bits, one op fewer."""
    return torch.exp(-x).add_(1.0).reciprocal_()


def naive_relu2(x: torch.Tensor) -> torch.Tensor:
    """``x [M, H]`` -> ``relu(x)^2 [M, H]`` in ``x.dtype``."""
    check_relu2_inputs(x)
    r = torch.clamp_min(x.float(), 0.0)
    return (r * r).to(x.dtype)


def naive_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate, up [M, I]`` -> ``silu(gate) * up [M, I]`` in their dtype."""
    check_silu_mul_inputs(gate, up)
    g32 = gate.float()
    return (g32 / (1.0 + torch.exp(-g32))).to(gate.dtype) * up
