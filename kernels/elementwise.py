"""Batch-invariant elementwise activations.

On CPU, torch's vectorised elementwise loops round some transcendental functions (sigmoid, SiLU,
softplus) differently in the vector body and in the scalar tail, so an element's bits can depend
on where it sits in the tensor, i.e. on how many other rows share the call. Padding the flattened
tensor to a multiple of ``_LANES`` sends every element through the vector body. CUDA kernels use
the same device function for every element, so CUDA tensors go straight through.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Elements per padded run: a multiple of every CPU vector width times torch's unroll factor.
_LANES = 64


def _every_element_vectorised(fn, x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return fn(x)
    flat = x.reshape(-1)
    pad = (-flat.numel()) % _LANES
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return fn(flat)[: x.numel()].view(x.shape)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return _every_element_vectorised(torch.sigmoid, x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return _every_element_vectorised(F.silu, x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return _every_element_vectorised(F.softplus, x)
