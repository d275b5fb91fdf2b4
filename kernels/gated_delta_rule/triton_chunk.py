"""Triton form of ``chunk_gated_delta_rule``: the five phases of the chunked (WY/UT) gated delta rule,
one launch each (algebra in README.md, buffers in phase_contract.py):

1. ``chunk_gdn_cumsum_kernel`` (triton_chunk_cumsum.py): the cumulative log decay in each chunk;
2. ``chunk_gdn_solve_kernel`` (triton_chunk_solve.py): ``K K^T`` and ``(I + A)^-1`` per chunk;
3. ``chunk_gdn_wy_kernel`` (triton_chunk_wy.py): ``w`` and ``u``;
4. ``chunk_gdn_state_kernel`` (triton_chunk_state.py): the sequential state pass, parallel over
   (row, value head, value block): the state at each chunk's start, ``v'`` and the final state;
5. ``chunk_gdn_output_kernel`` (triton_chunk_output.py): every chunk's output.

Phases 1-3 and 5 run every chunk of every row at once. Nothing is read back to the host: chunks are
numbered from ``cu_seqlens`` on the device (triton_chunk_common.py).

Products: on the GPU ``q k^T`` and ``k k^T`` take 16-bit inputs as they are (exact products into a
float32 accumulator); every product with a float32 operand (``(I + A)^-1``, ``S``, ``w``, ``u``,
``v'``, float32 inputs) is ``tf32x3``, close to full float32, because the prefill hands its state to
the recurrent decode. Under the interpreter every product is a float32 one.
"""

from __future__ import annotations

import torch

from kernels._contract import as_contiguous, as_index, write_back
from kernels.gated_delta_rule.contract import check_chunk_inputs
from kernels.gated_delta_rule.triton_chunk_common import num_slots
from kernels.gated_delta_rule.triton_chunk_cumsum import launch_cumsum
from kernels.gated_delta_rule.triton_chunk_output import launch_output
from kernels.gated_delta_rule.triton_chunk_solve import launch_solve, lowp_products
from kernels.gated_delta_rule.triton_chunk_state import launch_state
from kernels.gated_delta_rule.triton_chunk_wy import launch_wy
from kernels.gated_delta_rule.triton_recurrent import kernel_inputs, kernel_pool


def triton_chunk_gated_delta_rule(
    q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, has_initial_state, *,
    scale=None, use_qk_l2norm=True, chunk_size=64,
):
    """Triton wrapper; same contract as ``kernels.gated_delta_rule.chunk_gated_delta_rule``."""
    num_tokens, _, hv, dk, dv, n = check_chunk_inputs(
        q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, has_initial_state, scale, use_qk_l2norm,
        chunk_size)
    q, k, v, g, beta, cu_seqlens = kernel_inputs(q, k, v, g, beta, cu_seqlens)
    state_indices = as_index(state_indices)
    assert state_indices.dtype == torch.int32 and state_indices.is_contiguous(), "state_indices: int32"
    if has_initial_state is None:
        has_initial_state = torch.ones(n, dtype=torch.bool, device=q.device)
    has_initial_state = as_contiguous(has_initial_state)
    scale = dk ** -0.5 if scale is None else float(scale)
    o = torch.zeros(num_tokens, hv, dv, dtype=v.dtype, device=v.device)
    if num_tokens == 0 or n == 0:
        return o
    pool = kernel_pool(ssm_state)
    dev, f32 = q.device, torch.float32
    gc = torch.empty(num_tokens, hv, dtype=f32, device=dev)
    a_inv = torch.empty(num_tokens, hv, chunk_size, dtype=f32, device=dev)
    rk = torch.empty(num_tokens, hv, dtype=f32, device=dev)
    w = torch.empty(num_tokens, hv, dk, dtype=f32, device=dev)
    u = torch.empty(num_tokens, hv, dv, dtype=f32, device=dev)  # u, then v' (phase 4 rewrites it)
    h = torch.empty(num_slots(num_tokens, n, chunk_size), hv, dk, dv, dtype=f32, device=dev)
    lowp_qk = lowp_products(q, k)
    launch_cumsum(g, cu_seqlens, chunk_size, gc)
    launch_solve(k, beta, gc, cu_seqlens, chunk_size, use_qk_l2norm, lowp_qk, a_inv, rk)
    launch_wy(k, v, beta, gc, a_inv, rk, cu_seqlens, chunk_size, w, u)
    launch_state(k, w, u, gc, rk, pool, cu_seqlens, state_indices, has_initial_state, chunk_size, h)
    launch_output(q, k, u, gc, h, cu_seqlens, state_indices, chunk_size, scale, use_qk_l2norm, lowp_qk, o)
    write_back(ssm_state, pool)
    return o
