"""Input contract of ``paged_attention`` (kernels/_contract.py), called first by both backends.

The KV-cache block size is not part of it: the torch reference serves any block size, the Triton
kernel the ones ``kernels.attention.check_block_size`` accepts, which the engines check when they are
built for a CUDA device.
"""

from __future__ import annotations

from typing import NamedTuple

from kernels._contract import FLOATS, INDEX, Contract


class AttentionDims(NamedTuple):
    num_tokens: int
    num_q_heads: int
    head_dim: int
    block_size: int
    num_kv_heads: int
    num_rows: int


def check_paged_attention_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                                 scale) -> AttentionDims:
    """The contract of ``paged_attention`` (kernels/README.md)."""
    c = Contract("paged_attention")
    c.tensor("q", q, FLOATS, "T, Hq, D")
    c.tensor("k_cache", k_cache, FLOATS, "num_blocks, block_size, Hkv, D")
    c.tensor("v_cache", v_cache, FLOATS, "num_blocks, block_size, Hkv, D")
    c.at_least("k_cache", "Hkv", 1)
    c.multiple("q", "Hq", "Hkv")
    c.offsets("query_start_loc", query_start_loc)
    c.tensor("seq_lens", seq_lens, INDEX, "N")
    c.tensor("block_table", block_table, INDEX, "N, max_blocks")
    c.number("scale", scale)
    s = c.sizes
    return AttentionDims(s["T"], s["Hq"], s["D"], s["block_size"], s["Hkv"], s["N"])
