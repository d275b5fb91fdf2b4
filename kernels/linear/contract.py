"""Input contract of ``linear`` (kernels/_contract.py), called first by both backends."""

from __future__ import annotations

from kernels._contract import FLOATS, Contract, describe, dtype_name


def check_linear_inputs(x, weight) -> tuple[int, int, int]:
    """The contract of ``linear`` (kernels/README.md); returns (M, K, N)."""
    c = Contract("linear")
    c.tensor("x", x, FLOATS, "M, K")
    c.tensor("weight", weight, FLOATS, "N, K")
    if weight.dtype != x.dtype:
        c.refuse("weight", f"of x's dtype {dtype_name(x.dtype)}", describe(weight))
    return c.sizes["M"], c.sizes["K"], c.sizes["N"]
