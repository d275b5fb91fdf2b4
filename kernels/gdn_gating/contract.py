"""Input contract of ``gdn_gating`` (kernels/_contract.py), called first by both backends."""

from __future__ import annotations

from kernels._contract import FLOATS, Contract


def check_gdn_gating_inputs(a_log, a, dt_bias, b) -> tuple[int, int]:
    """The contract of ``gdn_gating`` (kernels/README.md); returns (T, Hv)."""
    c = Contract("gdn_gating")
    c.tensor("a", a, FLOATS, "T, Hv")
    c.tensor("b", b, FLOATS, "T, Hv")
    c.tensor("A_log", a_log, FLOATS, "Hv")
    c.tensor("dt_bias", dt_bias, FLOATS, "Hv")
    return c.sizes["T"], c.sizes["Hv"]
