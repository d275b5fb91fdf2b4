"""Input contracts of the Mamba2 ops (kernels/_contract.py), called first by both backends."""

from __future__ import annotations

from typing import NamedTuple

from kernels._contract import FLOATS, INDEX, Contract, describe
from kernels._recurrent_slots import check_slot_inputs

# The Triton chunk-scan kernel holds a [chunk, chunk] float32 tile of C B^T per program, and walks
# a row's chunks in one program per (row, head, block of P); 128 is what the released models use.
CHUNK_SIZES = (16, 32, 64, 128)
CHUNK_MAX_SLOTS = 65535  # the output kernel's chunk slots (T // chunk_size + 2 N) are a CUDA grid axis
MAX_STATE = 256  # N: the state kernels keep [BP, N] in registers


class MambaDims(NamedTuple):
    num_tokens: int
    heads: int  # H
    head_dim: int  # P
    groups: int  # G
    state: int  # N
    num_rows: int


def _check_common(c: Contract, x, dt, A, B, C, D, ssm_state, cu_seqlens) -> MambaDims:
    """Checks shared by both forms; binds T, H, P, G, N (and S, N rows as "R")."""
    c.tensor("x", x, FLOATS, "T, H, P")
    c.at_least("x", "H", 1)
    c.at_least("x", "P", 1)
    c.tensor("dt", dt, FLOATS, "T, H")
    c.tensor("A", A, FLOATS, "H")
    c.tensor("B", B, FLOATS, "T, G, Ns")
    c.at_least("B", "G", 1)
    c.at_least("B", "Ns", 1)
    c.require(c.sizes["Ns"] <= MAX_STATE, "B", f"a tensor with Ns <= {MAX_STATE} (the kernels' limit)",
              f"Ns = {c.sizes['Ns']}")
    c.multiple("x", "H", "G")
    c.tensor("C", C, FLOATS, "T, G, Ns")
    c.tensor("D", D, FLOATS, "H")
    c.tensor("ssm_state", ssm_state, FLOATS, "S, H, P, Ns")
    c.offsets("cu_seqlens", cu_seqlens)
    s = c.sizes
    return MambaDims(s["T"], s["H"], s["P"], s["G"], s["Ns"], s["N"])


def check_selective_state_update_inputs(x, dt, A, B, C, D, ssm_state, cu_seqlens, state_indices,
                                        num_valid, has_initial_state) -> MambaDims:
    """The contract of ``selective_state_update`` (kernels/README.md)."""
    c = Contract("selective_state_update")
    dims = _check_common(c, x, dt, A, B, C, D, ssm_state, cu_seqlens)
    check_slot_inputs(c, state_indices, has_initial_state, num_valid, speculative=True)
    return dims


def check_ssd_chunk_scan_inputs(x, dt, A, B, C, D, ssm_state, cu_seqlens, state_indices, has_initial_state,
                                start_positions, chunk_size, block_size, block_state_indices) -> MambaDims:
    """The contract of ``ssd_chunk_scan`` (kernels/README.md), with the Triton kernel's limits."""
    c = Contract("ssd_chunk_scan")
    dims = _check_common(c, x, dt, A, B, C, D, ssm_state, cu_seqlens)
    check_slot_inputs(c, state_indices, has_initial_state, speculative=False)
    c.tensor("start_positions", start_positions, INDEX, "N", optional=True)
    c.choice("chunk_size", chunk_size, CHUNK_SIZES)
    num_slots = dims.num_tokens // chunk_size + 2 * dims.num_rows
    c.require(num_slots <= CHUNK_MAX_SLOTS, "x",
              f"short enough that T // chunk_size + 2 N <= {CHUNK_MAX_SLOTS} (a CUDA grid axis)",
              f"T = {dims.num_tokens}, N = {dims.num_rows}")
    if block_size is None:
        c.require(block_state_indices is None, "block_state_indices", "None without block_size",
                  describe(block_state_indices))
    else:
        c.integer("block_size", block_size, chunk_size)
        c.require(block_size % chunk_size == 0, "block_size",
                  f"a multiple of chunk_size = {chunk_size} (block boundaries are chunk ends)",
                  describe(block_size))
        c.require(block_state_indices is not None, "block_state_indices",
                  "an int32 or int64 tensor of shape [N, M] with block_size", "None")
        c.tensor("block_state_indices", block_state_indices, INDEX, "N, M")
    return dims
