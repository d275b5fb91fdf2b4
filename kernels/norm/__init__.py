"""``rms_norm`` and ``gated_rms_norm`` (reductions over the last dimension of each row)."""

from __future__ import annotations

import torch

from kernels._dispatch import resolve_backend
from kernels.norm.naive import naive_gated_rms_norm, naive_rms_norm


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """``x [M, H]``, ``weight [H]`` -> ``[M, H]`` in ``x.dtype``:
    ``x32 * rsqrt(mean(x32^2) + eps) * (1 + w32 if zero_centered else w32)``."""
    if resolve_backend(backend, x, weight) == "torch":
        return naive_rms_norm(x, weight, eps, zero_centered=zero_centered)
    from kernels.norm.triton_rms_norm import triton_rms_norm

    return triton_rms_norm(x, weight, eps, zero_centered=zero_centered)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str | None = None
) -> torch.Tensor:
    """``x, z [M, Hv, Dv]``, ``weight [Dv]`` -> ``[M, Hv, Dv]`` in ``x.dtype``:
    ``(w * (x32 * rsqrt(mean(x32^2 over Dv) + eps)).to(dtype)) * silu(z32)``."""
    if resolve_backend(backend, x, z, weight) == "torch":
        return naive_gated_rms_norm(x, z, weight, eps)
    from kernels.norm.triton_rms_norm import triton_gated_rms_norm

    return triton_gated_rms_norm(x, z, weight, eps)


__all__ = ["gated_rms_norm", "naive_gated_rms_norm", "naive_rms_norm", "rms_norm"]
