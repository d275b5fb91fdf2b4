"""``gdn_gating``: the Gated DeltaNet's gates from its ``a`` and ``b`` projections (elementwise, one launch
for the dozen elementwise ops of the reference)."""

from __future__ import annotations

import torch

from kernels._dispatch import resolve_backend
from kernels.gdn_gating.naive import naive_gdn_gating

__all__ = ["gdn_gating", "naive_gdn_gating"]


def gdn_gating(a_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor, *,
               backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``A_log, dt_bias [Hv]``, ``a, b [T, Hv]`` -> float32 ``g = -exp(A_log) * softplus(a + dt_bias)``
    (<= 0) and ``beta = sigmoid(b)``, each ``[T, Hv]``."""
    if resolve_backend(backend, a, b) == "torch":
        return naive_gdn_gating(a_log, a, dt_bias, b)
    from kernels.gdn_gating.triton_gdn_gating import triton_gdn_gating

    return triton_gdn_gating(a_log, a, dt_bias, b)
