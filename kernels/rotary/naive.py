"""Reference for ``rotary_embedding``: NeoX-style RoPE on the first ``rotary_dim`` dims of each head.

Dims ``i`` and ``i + rd/2`` of the rotated part are a pair turned by ``positions * theta^(-2i/rd)``
(``rotate_half``). The frequencies, cosines and sines are float32, rounded to the inputs' dtype, and the
rotation ``x * cos + rotate_half(x) * sin`` is computed in that dtype (as transformers does): a 16-bit
product and sum round once each. ``rotate_half(x) * sin`` is ``roll(x, rd/2) * signed``, the sine's first
half negated (``-(b * s) == b * (-s)`` exactly); dims past ``rotary_dim`` pass through.
"""

from __future__ import annotations

import torch

from kernels.rotary.contract import check_rotary_inputs


def naive_cos_sin(positions: torch.Tensor, rotary_dim: int,
                  theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, rd] float32."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim
    inv_freq = 1.0 / (theta**exponent)  # [rd/2]
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, rd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, rd]
    return emb.cos(), emb.sin()


def naive_rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
                           theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``positions [T]`` -> the rotated q, k (new tensors)."""
    check_rotary_inputs(q, k, positions, rotary_dim, theta)
    return naive_rotate(q, k, *naive_cos_sin(positions, rotary_dim, theta))


def naive_rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation by given angles: ``cos, sin [T, rd]`` float32 (each half the same angles)."""
    rotary_dim = cos.shape[1]
    half = rotary_dim // 2
    cos = cos.to(q.dtype)[:, None, :]  # [T, 1, rd], once for q and k
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(q.dtype)[:, None, :]
    return _rotate(q, cos, signed, rotary_dim), _rotate(k, cos, signed, rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = rot.roll(rotary_dim // 2, dims=-1)  # [b, a] of rot = [a, b]
    return torch.cat((rot * cos + rotated * signed, rest), dim=-1)
