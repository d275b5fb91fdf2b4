"""The five phases of the chunked gated delta rule as ops of their own: each checks its contract
(phase_contract.py) and runs its torch reference (naive_phases.py) or its Triton kernel
(triton_chunk_<phase>.py) by the usual dispatch (kernels/_dispatch.py). ``chunk_gated_delta_rule``
chains the Triton launches itself after one check of the whole op's contract; these entry points let
each phase be checked and tested alone.
"""

from __future__ import annotations

import torch

from kernels._contract import as_contiguous, as_index, with_unit_stride
from kernels._dispatch import resolve_backend
from kernels.gated_delta_rule import naive_phases
from kernels.gated_delta_rule.phase_contract import (
    check_cumsum_inputs,
    check_output_inputs,
    check_solve_inputs,
    check_state_inputs,
    check_wy_inputs,
)

F32 = torch.float32


def _empty(c, shape: str, device) -> torch.Tensor:
    return torch.empty([c.sizes[d] for d in shape.split(", ")], dtype=F32, device=device)


def _has_rows(c) -> bool:
    return c.sizes["T"] > 0 and c.sizes["N"] > 0


def chunk_cumsum(g, cu_seqlens, chunk_size, *, backend=None):
    """Phase 1: ``gc [T, Hv]`` float32."""
    if resolve_backend(backend, g) == "torch":
        return naive_phases.chunk_cumsum(g, cu_seqlens, chunk_size)
    from kernels.gated_delta_rule.triton_chunk_cumsum import launch_cumsum

    c = check_cumsum_inputs(g, cu_seqlens, chunk_size)
    gc = _empty(c, "T, Hv", g.device)
    if _has_rows(c):
        launch_cumsum(with_unit_stride(g), as_index(cu_seqlens), chunk_size, gc)
    return gc


def chunk_solve(k, beta, gc, cu_seqlens, chunk_size, use_qk_l2norm=True, *, backend=None):
    """Phase 2: ``(a_inv [T, Hv, BT], rk [T, Hv])``."""
    if resolve_backend(backend, k) == "torch":
        return naive_phases.chunk_solve(k, beta, gc, cu_seqlens, chunk_size, use_qk_l2norm)
    from kernels.gated_delta_rule.triton_chunk_solve import launch_solve, lowp_products

    c = check_solve_inputs(k, beta, gc, cu_seqlens, chunk_size, use_qk_l2norm)
    a_inv, rk = _empty(c, "T, Hv, BT", k.device), _empty(c, "T, Hv", k.device)
    if _has_rows(c):
        launch_solve(with_unit_stride(k), with_unit_stride(beta), as_contiguous(gc), as_index(cu_seqlens),
                     chunk_size, use_qk_l2norm, lowp_products(k, k), a_inv, rk)
    return a_inv, rk


def chunk_wy(k, v, beta, gc, a_inv, rk, cu_seqlens, chunk_size, *, backend=None):
    """Phase 3: ``(w [T, Hv, Dk], u [T, Hv, Dv])``."""
    if resolve_backend(backend, k, v) == "torch":
        return naive_phases.chunk_wy(k, v, beta, gc, a_inv, rk, cu_seqlens, chunk_size)
    from kernels.gated_delta_rule.triton_chunk_wy import launch_wy

    c = check_wy_inputs(k, v, beta, gc, a_inv, rk, cu_seqlens, chunk_size)
    w, u = _empty(c, "T, Hv, Dk", k.device), _empty(c, "T, Hv, Dv", k.device)
    if _has_rows(c):
        launch_wy(with_unit_stride(k), with_unit_stride(v), with_unit_stride(beta), as_contiguous(gc),
                  as_contiguous(a_inv), as_contiguous(rk), as_index(cu_seqlens), chunk_size, w, u)
    return w, u


def chunk_state(k, w, u, gc, rk, ssm_state, cu_seqlens, state_indices, has_initial_state, chunk_size, *,
                backend=None):
    """Phase 4: ``(h [C, Hv, Dk, Dv], v' [T, Hv, Dv])``; the final states go to ``ssm_state``. The Triton
    form writes ``v'`` over a copy of ``u`` (the composed op lets it overwrite ``u`` itself)."""
    if resolve_backend(backend, k, ssm_state) == "torch":
        return naive_phases.chunk_state(k, w, u, gc, rk, ssm_state, cu_seqlens, state_indices,
                                        has_initial_state, chunk_size)
    from kernels._contract import write_back
    from kernels.gated_delta_rule.triton_chunk_state import launch_state
    from kernels.gated_delta_rule.triton_recurrent import kernel_pool

    c = check_state_inputs(k, w, u, gc, rk, ssm_state, cu_seqlens, state_indices, has_initial_state,
                           chunk_size)
    h, vnew = _empty(c, "C, Hv, Dk, Dv", k.device), u.clone(memory_format=torch.contiguous_format)
    if _has_rows(c):
        if has_initial_state is None:
            has_initial_state = torch.ones(c.sizes["N"], dtype=torch.bool, device=k.device)
        pool = kernel_pool(ssm_state)
        launch_state(with_unit_stride(k), as_contiguous(w), vnew, as_contiguous(gc), as_contiguous(rk), pool,
                     as_index(cu_seqlens), as_index(state_indices), as_contiguous(has_initial_state),
                     chunk_size, h)
        write_back(ssm_state, pool)
    return h, vnew


def chunk_output(q, k, vnew, gc, h, cu_seqlens, state_indices, chunk_size, scale, use_qk_l2norm=True, *,
                 out_dtype=None, backend=None):
    """Phase 5: ``o [T, Hv, Dv]`` in ``out_dtype`` (default ``vnew``'s), zeros at rows without a slot."""
    if resolve_backend(backend, q, vnew) == "torch":
        return naive_phases.chunk_output(q, k, vnew, gc, h, cu_seqlens, state_indices, chunk_size, scale,
                                         use_qk_l2norm, out_dtype=out_dtype)
    from kernels.gated_delta_rule.triton_chunk_output import launch_output
    from kernels.gated_delta_rule.triton_chunk_solve import lowp_products

    c = check_output_inputs(q, k, vnew, gc, h, cu_seqlens, state_indices, chunk_size, scale, use_qk_l2norm)
    o = torch.zeros(vnew.shape, dtype=out_dtype or vnew.dtype, device=q.device)
    if _has_rows(c):
        launch_output(with_unit_stride(q), with_unit_stride(k), as_contiguous(vnew), as_contiguous(gc),
                      as_contiguous(h), as_index(cu_seqlens), as_index(state_indices), chunk_size,
                      float(scale), use_qk_l2norm, lowp_products(q, k), o)
    return o
