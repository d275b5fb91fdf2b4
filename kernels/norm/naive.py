"""References for ``rms_norm`` and ``gated_rms_norm``.

Every reduction runs over the last dimension of one row, and every elementwise function used
(``rsqrt``, ``exp``) gives the same bits wherever the element sits in the tensor, so a row's
result does not depend on the other rows. ``silu`` is written as ``z / (1 + exp(-z))``:
``torch.sigmoid`` on CPU takes a different code path for the tail elements of a tensor and could
give a row different bits depending on the row count.
"""

from __future__ import annotations

import torch

from kernels.norm.contract import (
    check_gated_group_rms_norm_inputs,
    check_gated_rms_norm_inputs,
    check_rms_norm_inputs,
)


def silu_fp32(z: torch.Tensor) -> torch.Tensor:
    """``z * sigmoid(z)`` for float32 ``z``, position-independent bits."""
    return z / (1.0 + torch.exp(-z))


def _rms_normalize(x32: torch.Tensor, eps: float) -> torch.Tensor:
    variance = (x32 * x32).mean(dim=-1, keepdim=True)
    return x32 * torch.rsqrt(variance + eps)


def naive_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centered: bool = True
) -> torch.Tensor:
    """``x [M, H]``, ``weight [H]``:
    ``(x32 * rsqrt(mean(x32^2) + eps) * (1 + w32 if zero_centered else w32)).to(x.dtype)``."""
    check_rms_norm_inputs(x, weight, eps, zero_centered)
    w32 = weight.float()
    scale = 1.0 + w32 if zero_centered else w32
    return (_rms_normalize(x.float(), eps) * scale).to(x.dtype)


def naive_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x, z [M, Hv, Dv]``, ``weight [Dv]`` (norm before gate, weight used as-is):
    ``(w * (x32 * rsqrt(mean(x32^2 over Dv) + eps)).to(x.dtype)) * silu(z32)``, cast to ``x.dtype``."""
    check_gated_rms_norm_inputs(x, z, weight, eps)
    normed = _rms_normalize(x.float(), eps).to(x.dtype)
    return ((weight * normed) * silu_fp32(z.float())).to(x.dtype)


def naive_gated_group_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> torch.Tensor:
    """``x, z [M, I]``, ``weight [I]`` (gate before the norm, groups of ``group_size`` channels):
    ``g = x32 * silu(z32)``; ``y = (w * (g * rsqrt(mean(g^2 over the group) + eps)).to(dtype))``, cast
    to ``x.dtype``."""
    m, width = check_gated_group_rms_norm_inputs(x, z, weight, eps, group_size)
    gated = (x.float() * silu_fp32(z.float())).view(m, width // group_size, group_size)
    normed = _rms_normalize(gated, eps).view(m, width).to(x.dtype)
    return (weight * normed).to(x.dtype)
