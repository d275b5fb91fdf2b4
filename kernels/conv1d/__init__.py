"""Causal depthwise conv1d with a pooled conv state: prefill form and decode / verify form.

Window contract (kernels/README.md): the conv state of one request lives in the pool row of its
first state slot, ``conv_state[s]`` of shape ``[C, W-1+K]`` (K speculative tokens, 0 without
speculation). With ``a`` the number of tokens the previous step kept (``num_valid``,
1 when absent), the live window of the last ``W-1`` inputs, oldest first, is
``conv_state[s, :, a-1 : a-1+W-1]``.
"""

from __future__ import annotations

import torch

from kernels._dispatch import resolve_backend
from kernels.conv1d.naive import naive_causal_conv1d_fn, naive_causal_conv1d_update

__all__ = ["causal_conv1d_fn", "causal_conv1d_update", "naive_causal_conv1d_fn", "naive_causal_conv1d_update"]


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    backend: str | None = None,
) -> torch.Tensor:
    """Prefill form of the causal depthwise conv1d over varlen rows.

    Args:
        x: ``[T, C]`` (token-major; the channel dimension must have stride 1).
        weight: ``[C, W]``, ``W >= 2``; tap ``W-1`` multiplies the current token.
        conv_state: pool ``[S, C, W-1+K]``, modified in place.
        cu_seqlens: int32 ``[N+1]``.
        state_indices: int32 ``[N]``; ``PAD_SLOT_ID`` rows read and write nothing.
        has_initial_state: bool ``[N]`` (None: all True).
        bias: ``[C]`` or None; each output's sum starts from it (Nemotron-H's conv has one).
        activation: ``"silu"`` or None.

    Window contract, for row i with slot ``s`` and ``L`` tokens:

    - ``window_in = conv_state[s, :, 0:W-1]`` if ``has_initial_state[i]`` else zeros;
    - ``full = concat(window_in, x_row^T)`` (``[C, W-1+L]``);
    - ``out[t, c] = act(bias[c] + sum_j weight[c, j] * full[c, t + j])``, ``j = 0..W-1`` in that order;
    - afterwards ``conv_state[s, :, 0:W-1] = full[:, -(W-1):]`` (the last W-1 inputs);
      columns ``>= W-1`` are untouched.

    Rows of length 0 read and write nothing.

    Returns:
        out ``[T, C]`` in ``x.dtype`` (zeros for skipped rows and tokens past ``cu[N]``).
    """
    args = (x, weight, conv_state, cu_seqlens, state_indices, has_initial_state)
    if resolve_backend(backend, x, conv_state) == "torch":
        return naive_causal_conv1d_fn(*args, bias=bias, activation=activation)
    from kernels.conv1d.triton_conv1d import triton_causal_conv1d_fn

    return triton_causal_conv1d_fn(*args, bias=bias, activation=activation)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    num_valid: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    backend: str | None = None,
) -> torch.Tensor:
    """Decode / verify form of the causal depthwise conv1d (rows of ``L <= K+1`` tokens).

    Args:
        x: ``[T, C]``; weight: ``[C, W]``; conv_state: pool ``[S, C, W-1+K]``, in place.
        query_start_loc: int32 ``[N+1]``.
        state_indices: int32 ``[N]`` or ``[N, K+1]`` (only column 0 is used); ``PAD_SLOT_ID``
            rows read and write nothing.
        num_valid: int32 ``[N]`` (``1 <= a <= K+1``), None meaning all 1.
        bias: ``[C]`` or None; each output's sum starts from it.
        activation: ``"silu"`` or None.

    Window contract, for row i with slot ``s``, ``a = num_valid[i]`` and ``L`` tokens:

    - ``window_in = conv_state[s, :, a-1 : a-1+W-1]`` (read before anything is written);
    - ``full = concat(window_in, x_row^T)``;
      ``out[t, c] = act(bias[c] + sum_j weight[c, j] * full[c, t + j])``, ``j = 0..W-1`` in that order;
    - afterwards ``conv_state[s, :, 0 : W-2+L] = full[:, 1:]``, so the window after token j of
      this step is ``conv_state[s, :, j : j+W-1]`` and the next step reads at offset ``a'-1``;
      columns ``>= W-2+L`` are untouched.

    Rows of length 0 read and write nothing.

    Returns:
        out ``[T, C]`` in ``x.dtype``.
    """
    args = (x, weight, conv_state, query_start_loc, state_indices)
    opts = {"num_valid": num_valid, "bias": bias, "activation": activation}
    if resolve_backend(backend, x, conv_state) == "torch":
        return naive_causal_conv1d_update(*args, **opts)
    from kernels.conv1d.triton_conv1d import triton_causal_conv1d_update

    return triton_causal_conv1d_update(*args, **opts)
