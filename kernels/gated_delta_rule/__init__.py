"""Gated delta rule (Gated DeltaNet core): recurrent (decode / verify) and chunked (prefill) forms.

The recurrence is written out in README.md next to this file; shapes and the pool / padding
contract are in kernels/README.md.
"""

from __future__ import annotations

import torch

from kernels._dispatch import resolve_backend
from kernels.gated_delta_rule.naive import naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule

__all__ = [
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "naive_chunk_gated_delta_rule",
    "naive_recurrent_gated_delta_rule",
]


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    num_valid: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Token-by-token gated delta rule over varlen rows with states in a pool.

    Args:
        q, k: ``[T, Hk, Dk]``. v: ``[T, Hv, Dv]`` with ``Hv % Hk == 0``; value head ``h`` uses
            key head ``h // (Hv // Hk)``.
        g: ``[T, Hv]`` float32 log decay (<= 0). beta: ``[T, Hv]`` float32.
        ssm_state: pool ``[S, Hv, Dk, Dv]`` float32, modified in place.
        cu_seqlens: int32 ``[N+1]``, row i owns tokens ``cu[i]:cu[i+1]``.
        state_indices: int32 ``[N]`` (plain rows: initial state read from and final state
            written to ``ssm_state[idx[i]]``) or ``[N, K+1]`` (speculative rows: initial state
            from column ``num_valid[i] - 1``, the state after token t written to
            column t; needs ``len_i <= K+1``). A row whose read slot is ``PAD_SLOT_ID`` reads
            and writes nothing and outputs zeros; so does a row of length 0.
        num_valid: int32 ``[N]``, required with 2-D indices, ``1 <= a <= K+1``.
        has_initial_state: bool ``[N]``; where False the initial state is zeros whatever the
            slot holds. None means all True.
        scale: multiplies q after the L2 norm; default ``Dk ** -0.5``.
        use_qk_l2norm: L2-normalise q and k per token (``x / sqrt(sum(x^2) + 1e-6)``).
        backend: ``"torch"``, ``"triton"`` or None/``"auto"`` (see kernels/_dispatch.py).

    Returns:
        o ``[T, Hv, Dv]`` in ``v.dtype``; zeros for tokens of skipped rows and past ``cu[N]``.
    """
    args = (q, k, v, g, beta, ssm_state, cu_seqlens, state_indices)
    opts = {"num_valid": num_valid, "has_initial_state": has_initial_state,
            "scale": scale, "use_qk_l2norm": use_qk_l2norm}
    if resolve_backend(backend, q, v, ssm_state) == "torch":
        return naive_recurrent_gated_delta_rule(*args, **opts)
    from kernels.gated_delta_rule.triton_recurrent import triton_recurrent_gated_delta_rule

    return triton_recurrent_gated_delta_rule(*args, **opts)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    backend: str | None = None,
) -> torch.Tensor:
    """Gated delta rule in chunks of ``chunk_size`` tokens (WY/UT form), for prefill.

    Same arguments and math as :func:`fused_recurrent_gated_delta_rule` with plain 1-D
    ``state_indices [N]``: row i's initial state is ``ssm_state[idx[i]]`` (zeros where
    ``has_initial_state[i]`` is False) and its final state is written back there. Agrees with
    the recurrent form within float tolerance, not bitwise. ``chunk_size`` is a power of two
    >= 16 for the Triton kernel.

    Returns:
        o ``[T, Hv, Dv]`` in ``v.dtype``.
    """
    args = (q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, has_initial_state)
    opts = {"scale": scale, "use_qk_l2norm": use_qk_l2norm, "chunk_size": chunk_size}
    if resolve_backend(backend, q, v, ssm_state) == "torch":
        return naive_chunk_gated_delta_rule(*args, **opts)
    from kernels.gated_delta_rule.triton_chunk import triton_chunk_gated_delta_rule

    return triton_chunk_gated_delta_rule(*args, **opts)
