"""``rms_norm``, ``gated_rms_norm`` and ``gated_group_rms_norm`` (reductions over a row or a group of it)."""

from __future__ import annotations

import torch

from kernels._dispatch import resolve_backend
from kernels.norm.naive import naive_gated_group_rms_norm, naive_gated_rms_norm, naive_rms_norm


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


def gated_group_rms_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Mamba2's gated RMSNorm, gate before the norm: ``x, z [M, I]``, ``weight [I]`` -> ``[M, I]`` in
    ``x.dtype``.

    ``g = x32 * silu(z32)``, normalised over each group of ``group_size`` consecutive channels
    (``I // group_size`` groups; Nemotron-H: ``I / n_groups``) in float32:
    ``y = w * (g * rsqrt(mean(g^2 over the group) + eps)).to(x.dtype)``, cast to ``x.dtype``.
    """
    if resolve_backend(backend, x, z, weight) == "torch":
        return naive_gated_group_rms_norm(x, z, weight, eps, group_size)
    from kernels.norm.triton_rms_norm import triton_gated_group_rms_norm

    return triton_gated_group_rms_norm(x, z, weight, eps, group_size)


__all__ = [
    "gated_group_rms_norm",
    "gated_rms_norm",
    "naive_gated_group_rms_norm",
    "naive_gated_rms_norm",
    "naive_rms_norm",
    "rms_norm",
]
