"""Input contracts of the gated delta rule ops (kernels/_contract.py), called first by both backends."""

from __future__ import annotations

from typing import NamedTuple

from kernels._contract import FLOATS, Contract
from kernels._recurrent_slots import check_slot_inputs

# The Triton chunk kernels keep the state as at most four [64, BV] tiles and launch one program per
# chunk slot on a grid axis of at most 65535; a chunk of more than 64 tokens does not fit an A100's
# shared memory (python -m kernels.compile_check). The torch reference refuses the same inputs.
CHUNK_MAX_DK = 256
CHUNK_SIZES = (16, 32, 64)
CHUNK_MAX_SLOTS = 65535


class GdnDims(NamedTuple):
    num_tokens: int
    hk: int
    hv: int
    dk: int
    dv: int
    num_rows: int


def _check_common(c: Contract, q, k, v, g, beta, ssm_state, cu_seqlens, scale, use_qk_l2norm) -> GdnDims:
    """Checks shared by the recurrent and chunked forms; binds T, Hk, Hv, Dk, Dv and N."""
    c.tensor("q", q, FLOATS, "T, Hk, Dk")
    c.at_least("q", "Hk", 1)
    c.at_least("q", "Dk", 1)
    c.tensor("k", k, FLOATS, "T, Hk, Dk")
    c.tensor("v", v, FLOATS, "T, Hv, Dv")
    c.multiple("v", "Hv", "Hk")
    c.at_least("v", "Dv", 1)
    c.tensor("g", g, FLOATS, "T, Hv")
    c.tensor("beta", beta, FLOATS, "T, Hv")
    c.tensor("ssm_state", ssm_state, FLOATS, "S, Hv, Dk, Dv")
    c.offsets("cu_seqlens", cu_seqlens)
    c.number("scale", scale, optional=True)
    c.flag("use_qk_l2norm", use_qk_l2norm)
    s = c.sizes
    return GdnDims(s["T"], s["Hk"], s["Hv"], s["Dk"], s["Dv"], s["N"])


def check_recurrent_inputs(q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, num_valid,
                           has_initial_state, scale, use_qk_l2norm) -> GdnDims:
    """The contract of ``fused_recurrent_gated_delta_rule`` (kernels/README.md)."""
    c = Contract("fused_recurrent_gated_delta_rule")
    dims = _check_common(c, q, k, v, g, beta, ssm_state, cu_seqlens, scale, use_qk_l2norm)
    check_slot_inputs(c, state_indices, has_initial_state, num_valid, speculative=True)
    return dims


def check_chunk_inputs(q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, has_initial_state, scale,
                       use_qk_l2norm, chunk_size) -> GdnDims:
    """The contract of ``chunk_gated_delta_rule`` (kernels/README.md), with the Triton kernels' limits."""
    c = Contract("chunk_gated_delta_rule")
    dims = _check_common(c, q, k, v, g, beta, ssm_state, cu_seqlens, scale, use_qk_l2norm)
    c.require(dims.dk <= CHUNK_MAX_DK, "q", f"a tensor with Dk <= {CHUNK_MAX_DK} (the chunk kernels' limit)",
              f"Dk = {dims.dk}")
    check_slot_inputs(c, state_indices, has_initial_state, speculative=False)
    c.choice("chunk_size", chunk_size, CHUNK_SIZES)
    num_slots = dims.num_tokens // chunk_size + dims.num_rows
    c.require(num_slots <= CHUNK_MAX_SLOTS, "q",
              f"short enough that T // chunk_size + N <= {CHUNK_MAX_SLOTS} (a CUDA grid axis)",
              f"T = {dims.num_tokens}, N = {dims.num_rows}")
    return dims
