"""Input contract of ``paged_attention`` (kernels/_contract.py), called first by both backends.

The KV-cache block size is not part of it: the torch reference serves any block size, the Triton
kernel the ones ``check_block_size`` (below) accepts, which the engines check when they are built for
a CUDA device.
"""

from __future__ import annotations

from typing import NamedTuple

from kernels._contract import FLOATS, INDEX, Contract

# The Triton kernel groups cache blocks into tiles of max(block_size, 16) keys, so a block size must
# be a power of two; above 64 a float32 tile at head dim 256 needs more shared memory than an A100
# or H100 block may have (kernels/attention/compile_cases.py, python -m kernels.compile_check).
MAX_TRITON_BLOCK_SIZE = 64


def check_block_size(block_size: int) -> None:
    """Raise ValueError, naming ``block_size``, when the Triton paged attention cannot take it.

    It takes a power of two from 1 to ``MAX_TRITON_BLOCK_SIZE`` (the torch reference takes any
    positive size). Engines call this when they are built for a CUDA device.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ValueError(f"block_size must be an int, got {block_size!r}")  # noqa: TRY004 -- a bad setting
    if not 1 <= block_size <= MAX_TRITON_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(
            f"block_size={block_size} cannot be served by the Triton paged attention: it takes a "
            f"power of two from 1 to {MAX_TRITON_BLOCK_SIZE}"
        )


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
