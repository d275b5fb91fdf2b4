"""Input contracts of ``relu2`` and ``silu_mul`` (kernels/_contract.py), called first by both backends."""

from __future__ import annotations

from kernels._contract import FLOATS, Contract, dtype_name


def check_relu2_inputs(x) -> tuple[int, int]:
    """The contract of ``relu2`` (kernels/README.md); returns (M, H)."""
    c = Contract("relu2")
    c.tensor("x", x, FLOATS, "M, H")
    return c.sizes["M"], c.sizes["H"]


def check_silu_mul_inputs(gate, up) -> tuple[int, int]:
    """The contract of ``silu_mul`` (kernels/README.md); returns (M, I)."""
    c = Contract("silu_mul")
    c.tensor("gate", gate, FLOATS, "M, I")
    c.tensor("up", up, FLOATS, "M, I")
    c.require(up.dtype == gate.dtype, "up", f"gate's dtype ({dtype_name(gate.dtype)})", dtype_name(up.dtype))
    return c.sizes["M"], c.sizes["I"]
