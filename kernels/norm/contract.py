"""Input contracts of the norms (kernels/_contract.py), called first by both backends."""

from __future__ import annotations

from kernels._contract import FLOATS, Contract, describe


def check_rms_norm_inputs(x, weight, eps, zero_centered) -> tuple[int, int]:
    """The contract of ``rms_norm`` (kernels/README.md); returns (M, H)."""
    c = Contract("rms_norm")
    c.tensor("x", x, FLOATS, "M, H")
    c.tensor("weight", weight, FLOATS, "H")
    c.number("eps", eps)
    c.flag("zero_centered", zero_centered)
    return c.sizes["M"], c.sizes["H"]


def check_gated_rms_norm_inputs(x, z, weight, eps) -> tuple[int, int, int]:
    """The contract of ``gated_rms_norm`` (kernels/README.md); returns (M, Hv, Dv)."""
    c = Contract("gated_rms_norm")
    c.tensor("x", x, FLOATS, "M, Hv, Dv")
    c.tensor("z", z, FLOATS, "M, Hv, Dv")
    c.tensor("weight", weight, FLOATS, "Dv")
    c.number("eps", eps)
    return c.sizes["M"], c.sizes["Hv"], c.sizes["Dv"]


def check_gated_group_rms_norm_inputs(x, z, weight, eps, group_size) -> tuple[int, int]:
    """The contract of ``gated_group_rms_norm`` (kernels/README.md); returns (M, I)."""
    c = Contract("gated_group_rms_norm")
    c.tensor("x", x, FLOATS, "M, I")
    c.tensor("z", z, FLOATS, "M, I")
    c.tensor("weight", weight, FLOATS, "I")
    c.number("eps", eps)
    width = c.sizes["I"]
    c.integer("group_size", group_size, 1)
    c.require(width % group_size == 0, "group_size", f"a divisor of I = {width}", describe(group_size))
    return c.sizes["M"], width
