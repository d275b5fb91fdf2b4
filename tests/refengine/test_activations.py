"""The model's activations give an element the same bits wherever it sits in the tensor (contract 8)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import naive_silu_mul
from refengine.model import layers


def silu(x: torch.Tensor) -> torch.Tensor:
    """The MLPs' silu (``kernels.silu_mul``'s reference, times ones: exact)."""
    return naive_silu_mul(x[None], torch.ones_like(x)[None])[0]

# The bits of torch's CPU vector and scalar paths are what the helpers guard against (CPU only).


@pytest.mark.parametrize(
    "name,plain", [("sigmoid", torch.sigmoid), ("silu", F.silu), ("softplus", F.softplus)]
)
def test_position_independent(name, plain):
    fn = silu if name == "silu" else getattr(layers, name)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4
    whole = fn(x)
    assert torch.allclose(whole, plain(x), rtol=1e-6, atol=1e-7)
    for offset in range(0, 64, 3):
        for n in (1, 5, 13, 17, 100, 333):
            part = fn(x[offset: offset + n].clone())
            assert torch.equal(part, whole[offset: offset + n]), f"{name}: offset {offset}, length {n}"


def test_plain_torch_is_not_position_independent():
    """Shows what the helpers guard against: without padding some elements change bits."""
    x = torch.randn(4096) * 4
    whole = F.softplus(x)
    mismatches = sum(
        int((F.softplus(x[o: o + n].clone()) != whole[o: o + n]).sum())
        for o in range(0, 64, 3) for n in (5, 13, 17, 100, 333)
    )
    if mismatches == 0:
        pytest.skip("this CPU's vector and scalar paths agree; nothing to show")
    assert mismatches > 0
