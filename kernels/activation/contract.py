"""Input contract of ``relu2`` (kernels/_contract.py), called first by both backends."""

from __future__ import annotations

from kernels._contract import FLOATS, Contract


def check_relu2_inputs(x) -> tuple[int, int]:
    """The contract of ``relu2`` (kernels/README.md); returns (M, H)."""
    c = Contract("relu2")
    c.tensor("x", x, FLOATS, "M, H")
    return c.sizes["M"], c.sizes["H"]
