"""Mamba2 (SSD) state-space layer: recurrent (decode / verify / default prefill) and chunked (prefill) forms.

The recurrence and the math as the served models run it are written out in README.md next to this
file; shapes and the pool / padding contract are in kernels/README.md.
"""

from __future__ import annotations

import torch

from kernels._dispatch import resolve_backend
from kernels.mamba2.naive import naive_selective_state_update, naive_ssd_chunk_scan

__all__ = ["naive_selective_state_update", "naive_ssd_chunk_scan", "selective_state_update", "ssd_chunk_scan"]


def selective_state_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    ssm_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    num_valid: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Token-by-token Mamba2 recurrence over varlen rows with states in a pool.

    Args:
        x: ``[T, H, P]`` (the conv output's x part, per head).
        dt: ``[T, H]`` float32, already ``softplus(dt_raw + dt_bias)`` (no clamp).
        A: ``[H]`` float32, ``-exp(A_log)``. D: ``[H]`` skip weight.
        B, C: ``[T, G, N]`` with ``H % G == 0``; head ``h`` uses group ``h // (H // G)``.
        ssm_state: pool ``[S, H, P, N]`` (float32 in the served models), modified in place.
        cu_seqlens: int32 ``[N+1]``, row i owns tokens ``cu[i]:cu[i+1]``.
        state_indices: int32 ``[N]`` (plain rows: initial state read from and final state written
            to ``ssm_state[idx[i]]``) or ``[N, K+1]`` (speculative rows: initial state from column
            ``num_valid[i] - 1``, the state after token t written to column t; needs
            ``len_i <= K+1``; PAD columns are not written). A row whose read slot is ``PAD_SLOT_ID``
            reads and writes nothing and outputs zeros; so does a row of length 0.
        num_valid: int32 ``[N]``, required with 2-D indices, ``1 <= a <= K+1``.
        has_initial_state: bool ``[N]``; where False the initial state is zeros whatever the slot
            holds. None means all True.
        backend: ``"torch"``, ``"triton"`` or None/``"auto"`` (see kernels/_dispatch.py).

    Per token, in float32: ``S = S * exp(dt*A) + (x*dt) outer B_g``; ``y = S . C_g + D * x``
    (the output reads the state after the update).

    Returns:
        y ``[T, H, P]`` in ``x.dtype``; zeros for tokens of skipped rows and past ``cu[N]``.
    """
    args = (x, dt, A, B, C, D, ssm_state, cu_seqlens, state_indices)
    opts = {"num_valid": num_valid, "has_initial_state": has_initial_state}
    if resolve_backend(backend, x, ssm_state) == "torch":
        return naive_selective_state_update(*args, **opts)
    from kernels.mamba2.triton_state_update import triton_selective_state_update

    return triton_selective_state_update(*args, **opts)


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    ssm_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    *,
    start_positions: torch.Tensor | None = None,
    chunk_size: int = 128,
    block_size: int | None = None,
    block_state_indices: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The Mamba2 recurrence in chunks (the SSD form), for prefill.

    Same arguments and math as :func:`selective_state_update` with plain 1-D ``state_indices [N]``:
    row i's initial state is ``ssm_state[idx[i]]`` (zeros where ``has_initial_state[i]`` is False;
    None means all True) and its final state is written back there. Agrees with the recurrent form
    within float tolerance, not bitwise.

    Args:
        start_positions: int32 ``[N]``, the absolute position (tokens already in the state) of each
            row's first token; None means 0. Chunks are cut at absolute multiples of ``chunk_size``:
            a row starting at ``p`` has a first chunk ending at the next multiple, so a prefill
            split at multiples of ``chunk_size`` runs exactly the chunks of the unsplit one.
        chunk_size: one of 16, 32, 64, 128 (the released models use 128).
        block_size: with ``block_state_indices`` int32 ``[N, M]``: the state after every absolute
            position ``b`` that is a multiple of ``block_size`` with ``p < b <= p + len_i`` (the
            j-th such boundary of the row, j = 0, 1, ...) is also written to
            ``ssm_state[block_state_indices[i, j]]``; PAD entries and ``j >= M`` are not written.
            ``block_size`` must be a multiple of ``chunk_size`` (boundaries are chunk ends).

    Returns:
        y ``[T, H, P]`` in ``x.dtype``; zeros for tokens of skipped rows and past ``cu[N]``.
    """
    args = (x, dt, A, B, C, D, ssm_state, cu_seqlens, state_indices, has_initial_state)
    opts = {"start_positions": start_positions, "chunk_size": chunk_size, "block_size": block_size,
            "block_state_indices": block_state_indices}
    if resolve_backend(backend, x, ssm_state) == "torch":
        return naive_ssd_chunk_scan(*args, **opts)
    from kernels.mamba2.triton_chunk_scan import triton_ssd_chunk_scan

    return triton_ssd_chunk_scan(*args, **opts)
