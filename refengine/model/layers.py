"""Small building blocks: projection, zero-centred RMSNorm, SwiGLU MLP, partial NeoX RoPE.

Batch invariance on CPU: ``torch.sigmoid``, ``F.silu`` and ``F.softplus`` round the vectorised
body and the scalar tail of a tensor differently, so a value's bits could depend on how many rows
share the call. The helpers below use only ``exp`` / ``log1p`` and exact arithmetic, which give
the same bits wherever an element sits.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from kernels.activation.naive import sigmoid_fp32, softplus_fp32
from kernels.rotary import naive_cos_sin, naive_rotate


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), computed in float32, returned in x.dtype."""
    return sigmoid_fp32(x.float()).to(x.dtype)


softplus = softplus_fp32  # log(1 + exp(x)) (x itself above 20), for float32 x


class Linear(nn.Module):
    """A bias-free projection through the batch-invariant ``kernels.linear``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [N, K]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [M, K] -> [M, N]
        return kernels.linear(x, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis; ``zero_centered`` scales by (1 + w) (weights stored around 0)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        init = torch.zeros(dim) if zero_centered else torch.ones(dim)
        self.weight = nn.Parameter(init)  # [dim]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., dim] -> [..., dim]
        if x.dim() == 2:  # the kernel's own shape: no views around it
            return kernels.rms_norm(x, self.weight, self.eps, zero_centered=self.zero_centered)
        shape = x.shape
        y = kernels.rms_norm(
            x.reshape(-1, shape[-1]), self.weight, self.eps, zero_centered=self.zero_centered
        )
        return y.view(shape)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the GDN output, weight used as-is, then times silu(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # [Dv]

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # x, z [M, Hv, Dv] -> [M, Hv, Dv]
        return kernels.gated_rms_norm(x, z, self.weight, self.eps)


class MLP(nn.Module):
    """Dense SwiGLU: down(silu(gate(x)) * up(x)), the gated activation one ``kernels.silu_mul``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size)  # [I, H]
        self.up_proj = Linear(hidden_size, intermediate_size)  # [I, H]
        self.down_proj = Linear(intermediate_size, hidden_size)  # [H, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, H] -> [T, H]
        return self.down_proj(kernels.silu_mul(self.gate_proj(x), self.up_proj(x)))


class PartialRotary(nn.Module):
    """NeoX-style RoPE on the first ``rotary_dim`` dims of each head (rotate_half pairs i, i + rd/2):
    ``kernels.rotary_embedding``, one launch for q and k each.

    Holds no tensors: the inverse frequencies ``theta^(-2i/rd)`` are computed in float32 on the positions'
    device (inside the kernel on CUDA), so casting the model to another dtype never touches them. A
    subclass whose frequencies are not those (``plain`` False) gives its own ``cos_sin``; the rotation is
    the kernels' reference then.
    """

    plain = True  # the frequencies are theta^(-2i/rd)

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta = theta

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, rd] float32."""
        return naive_cos_sin(positions, self.rotary_dim, self.theta)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, Hq, D], k [T, Hkv, D], positions [T]
        if self.plain:
            return kernels.rotary_embedding(q, k, positions, self.rotary_dim, self.theta)
        return naive_rotate(q, k, *self.cos_sin(positions))
