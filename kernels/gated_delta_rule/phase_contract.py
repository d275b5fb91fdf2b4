"""Input contracts of the five phases of the chunked gated delta rule (kernels/_contract.py).

The phases (kernels/gated_delta_rule/README.md) exchange token-major float32 buffers:

- ``gc [T, Hv]``: the cumulative log decay inside each chunk (phase 1, ``chunk_cumsum``);
- ``a_inv [T, Hv, BT]``: row ``t - c0`` of ``(I + A)^-1`` for t's chunk starting at c0, columns by
  position in the chunk, and ``rk [T, Hv]``, ``1 / |k_t|`` (1 without the L2 norm) (phase 2,
  ``chunk_solve``);
- ``w [T, Hv, Dk]``, ``u [T, Hv, Dv]``: the WY representation (phase 3, ``chunk_wy``);
- ``h [C, Hv, Dk, Dv]`` with ``C = T // BT + N`` chunk slots: the state at each chunk's start, and
  ``v' [T, Hv, Dv]`` (phase 4, ``chunk_state``, the only sequential one; it updates the pool);
- ``o [T, Hv, Dv]`` (phase 5, ``chunk_output``).

Chunks are cut at each row's start and every ``BT`` tokens after it; row i's chunks sit in the chunk
slots from ``cu[i] // BT + i`` on (kernels/gated_delta_rule/triton_chunk_common.py). A buffer's
values at tokens outside every row, and phase 4's and 5's at rows whose state index is
``PAD_SLOT_ID``, are unspecified (the composed op zeroes ``o`` there).
"""

from __future__ import annotations

from kernels._contract import FLOATS, Contract
from kernels._recurrent_slots import check_slot_inputs
from kernels.gated_delta_rule.contract import CHUNK_MAX_DK, CHUNK_MAX_SLOTS, CHUNK_SIZES

F32 = (FLOATS[0],)


def _rows_and_chunks(c: Contract, cu_seqlens, chunk_size) -> None:
    """``cu_seqlens`` and ``chunk_size``; binds N and C (the chunk slots) once T is bound."""
    c.offsets("cu_seqlens", cu_seqlens)
    c.choice("chunk_size", chunk_size, CHUNK_SIZES)
    slots = c.sizes["T"] // chunk_size + c.sizes["N"]
    c.require(slots <= CHUNK_MAX_SLOTS, "cu_seqlens",
              f"for rows whose T // chunk_size + N <= {CHUNK_MAX_SLOTS} (a CUDA grid axis)",
              f"T = {c.sizes['T']}, N = {c.sizes['N']}")
    c.bind("C", slots)
    c.bind("BT", chunk_size)


def _keys(c: Contract, name: str, x) -> None:
    c.tensor(name, x, FLOATS, "T, Hk, Dk")
    c.at_least(name, "Hk", 1)
    c.at_least(name, "Dk", 1)
    c.require(c.sizes["Dk"] <= CHUNK_MAX_DK, name,
              f"a tensor with Dk <= {CHUNK_MAX_DK} (the chunk kernels' limit)", f"Dk = {c.sizes['Dk']}")


def _per_head(c: Contract, gc, beta=None) -> None:
    if beta is not None:
        c.tensor("beta", beta, FLOATS, "T, Hv")
    c.tensor("gc", gc, F32, "T, Hv")
    c.multiple("gc", "Hv", "Hk")


def check_cumsum_inputs(g, cu_seqlens, chunk_size) -> Contract:
    """Phase 1: ``g [T, Hv]`` log decay."""
    c = Contract("chunk_cumsum")
    c.tensor("g", g, FLOATS, "T, Hv")
    _rows_and_chunks(c, cu_seqlens, chunk_size)
    return c


def check_solve_inputs(k, beta, gc, cu_seqlens, chunk_size, use_qk_l2norm) -> Contract:
    """Phase 2: keys, ``beta [T, Hv]`` and phase 1's ``gc``."""
    c = Contract("chunk_solve")
    _keys(c, "k", k)
    _per_head(c, gc, beta)
    _rows_and_chunks(c, cu_seqlens, chunk_size)
    c.flag("use_qk_l2norm", use_qk_l2norm)
    return c


def check_wy_inputs(k, v, beta, gc, a_inv, rk, cu_seqlens, chunk_size) -> Contract:
    """Phase 3: keys, values ``[T, Hv, Dv]``, ``beta``, and phases 1 and 2's ``gc``, ``a_inv``, ``rk``."""
    c = Contract("chunk_wy")
    _keys(c, "k", k)
    c.tensor("v", v, FLOATS, "T, Hv, Dv")
    c.at_least("v", "Dv", 1)
    _per_head(c, gc, beta)
    _rows_and_chunks(c, cu_seqlens, chunk_size)
    c.tensor("a_inv", a_inv, F32, "T, Hv, BT")
    c.tensor("rk", rk, F32, "T, Hv")
    return c


def check_state_inputs(k, w, u, gc, rk, ssm_state, cu_seqlens, state_indices, has_initial_state,
                       chunk_size) -> Contract:
    """Phase 4: keys, phase 3's ``w`` and ``u``, ``gc``, ``rk`` and the state pool with its slots."""
    c = Contract("chunk_state")
    _keys(c, "k", k)
    c.tensor("w", w, F32, "T, Hv, Dk")
    c.tensor("u", u, F32, "T, Hv, Dv")
    c.at_least("u", "Dv", 1)
    _per_head(c, gc)
    c.tensor("rk", rk, F32, "T, Hv")
    c.tensor("ssm_state", ssm_state, FLOATS, "S, Hv, Dk, Dv")
    _rows_and_chunks(c, cu_seqlens, chunk_size)
    check_slot_inputs(c, state_indices, has_initial_state, speculative=False)
    return c


def check_output_inputs(q, k, vnew, gc, h, cu_seqlens, state_indices, chunk_size, scale,
                        use_qk_l2norm) -> Contract:
    """Phase 5: queries and keys, phase 4's ``v'`` and ``h``, ``gc``, and the rows' state indices (rows
    whose index is ``PAD_SLOT_ID`` have no output)."""
    c = Contract("chunk_output")
    c.tensor("q", q, FLOATS, "T, Hk, Dk")
    _keys(c, "k", k)
    c.tensor("vnew", vnew, F32, "T, Hv, Dv")
    c.at_least("vnew", "Dv", 1)
    _per_head(c, gc)
    _rows_and_chunks(c, cu_seqlens, chunk_size)
    c.tensor("h", h, F32, "C, Hv, Dk, Dv")
    check_slot_inputs(c, state_indices, None, speculative=False)
    c.number("scale", scale)
    c.flag("use_qk_l2norm", use_qk_l2norm)
    return c
