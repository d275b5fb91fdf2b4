"""Reference for ``relu2``: ``relu(x) ** 2``, squared in float32 and rounded once to ``x.dtype``.

A 16-bit square computed by torch (float32 arithmetic, one rounding) gives the same bits, so this
equals transformers' ``square(relu(x))`` in every dtype.
"""

from __future__ import annotations

import torch

from kernels.activation.contract import check_relu2_inputs


def naive_relu2(x: torch.Tensor) -> torch.Tensor:
    """``x [M, H]`` -> ``relu(x)^2 [M, H]`` in ``x.dtype``."""
    check_relu2_inputs(x)
    r = torch.clamp_min(x.float(), 0.0)
    return (r * r).to(x.dtype)
