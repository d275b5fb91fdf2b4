"""Input contract of ``rotary_embedding`` (kernels/_contract.py), called first by both backends."""

from __future__ import annotations

from kernels._contract import FLOATS, INDEX, Contract, describe, dtype_name


def check_rotary_inputs(q, k, positions, rotary_dim, theta) -> tuple[int, int, int, int]:
    """The contract of ``rotary_embedding`` (kernels/README.md); returns (T, Hq, Hkv, D)."""
    c = Contract("rotary_embedding")
    c.tensor("q", q, FLOATS, "T, Hq, D")
    c.tensor("k", k, FLOATS, "T, Hkv, D")
    c.require(k.dtype == q.dtype, "k", f"q's dtype ({dtype_name(q.dtype)})", dtype_name(k.dtype))
    c.tensor("positions", positions, INDEX, "T")
    d = c.sizes["D"]
    c.integer("rotary_dim", rotary_dim, 2, d)
    c.require(rotary_dim % 2 == 0, "rotary_dim", f"an even int from 2 to D = {d}", describe(rotary_dim))
    c.number("theta", theta)
    c.require(theta > 0, "theta", "a float > 0", describe(theta))
    return c.sizes["T"], c.sizes["Hq"], c.sizes["Hkv"], d
