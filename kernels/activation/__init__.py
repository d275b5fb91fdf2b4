"""``relu2``: the squared ReLU of Nemotron-H's MLPs and experts (elementwise)."""

from __future__ import annotations

import torch

from kernels._dispatch import resolve_backend
from kernels.activation.naive import naive_relu2

__all__ = ["naive_relu2", "relu2"]


def relu2(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``x [M, H]`` -> ``relu(x) ** 2`` ``[M, H]`` in ``x.dtype`` (squared in float32, one rounding)."""
    if resolve_backend(backend, x) == "torch":
        return naive_relu2(x)
    from kernels.activation.triton_relu2 import triton_relu2

    return triton_relu2(x)
