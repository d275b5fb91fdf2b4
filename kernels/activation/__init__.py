"""``relu2``: the squared ReLU of Nemotron-H's MLPs and experts; ``silu_mul``: SwiGLU's gated activation of
the dense MLPs (elementwise)."""

from __future__ import annotations

import torch

from kernels._dispatch import resolve_backend
from kernels.activation.naive import naive_relu2, naive_silu_mul

__all__ = ["naive_relu2", "naive_silu_mul", "relu2", "silu_mul"]


def relu2(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``x [M, H]`` -> ``relu(x) ** 2`` ``[M, H]`` in ``x.dtype`` (squared in float32, one rounding)."""
    if resolve_backend(backend, x) == "torch":
        return naive_relu2(x)
    from kernels.activation.triton_relu2 import triton_relu2

    return triton_relu2(x)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``gate, up [M, I]`` (one dtype) -> ``silu(gate) * up`` ``[M, I]``: the silu in float32, rounded to the
    dtype, times ``up`` rounded once (one launch for the three or four elementwise ops it replaces)."""
    if resolve_backend(backend, gate, up) == "torch":
        return naive_silu_mul(gate, up)
    from kernels.activation.triton_silu_mul import triton_silu_mul

    return triton_silu_mul(gate, up)
