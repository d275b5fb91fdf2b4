"""Input contract of ``reshape_and_cache`` (kernels/_contract.py), called first by both backends."""

from __future__ import annotations

from kernels._contract import FLOATS, INDEX, Contract


def check_reshape_and_cache_inputs(k, v, k_cache, v_cache, slot_mapping) -> None:
    """The contract of ``reshape_and_cache`` (kernels/README.md)."""
    c = Contract("reshape_and_cache")
    c.tensor("k", k, FLOATS, "T, Hkv, D")
    c.tensor("v", v, FLOATS, "T, Hkv, D")
    c.tensor("k_cache", k_cache, FLOATS, "num_blocks, block_size, Hkv, D")
    c.tensor("v_cache", v_cache, FLOATS, "num_blocks, block_size, Hkv, D")
    c.tensor("slot_mapping", slot_mapping, INDEX, "T")
