"""Plain-torch references for the Mamba2 (SSD) state-space layer (the ops' specification; README.md).

Both compute in float32 and are batch-invariant: a row's outputs and state writes do not depend on
which other rows share the call. The recurrent reference processes, for each token index t, all rows
that have a token t at once, with elementwise ops and reductions over a row's own state dimension
only. The chunk reference runs each sequence on its own, one chunk at a time.
"""

from __future__ import annotations

import torch

from kernels._recurrent_slots import (
    gather_initial_states,
    initial_state_flags,
    read_slots,
    row_bounds,
    write_token_states,
)
from kernels.constants import PAD_SLOT_ID
from kernels.mamba2.contract import check_selective_state_update_inputs, check_ssd_chunk_scan_inputs


def per_head(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[T, G, N]`` -> ``[T, H, N]`` float32: head h reads group ``h // (H // G)``."""
    t = t.float()
    group = num_heads // t.shape[1]
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def naive_selective_state_update(
    x, dt, A, B, C, D, ssm_state, cu_seqlens, state_indices, *,
    num_valid=None, has_initial_state=None,
):
    """Token-by-token Mamba2 recurrence over a pooled state (see kernels/README.md).

    x: [T, H, P]; dt: [T, H] (already softplus'd); A, D: [H]; B, C: [T, G, N]; ssm_state:
    [S, H, P, N] updated in place; cu_seqlens [N+1]; state_indices [N] (plain rows) or [N, K+1]
    (speculative rows: read column a-1, the state after token t written to column t). Per token, in
    float32: ``S = S * exp(dt*A) + (x*dt) outer B``; ``y = sum_n S[:, n] * C[n] + D * x``.
    Returns y: [T, H, P] in x.dtype, zeros for tokens of skipped rows.
    """
    check_selective_state_update_inputs(x, dt, A, B, C, D, ssm_state, cu_seqlens, state_indices,
                                        num_valid, has_initial_state)
    num_tokens, num_heads, head_dim = x.shape
    starts, lens = row_bounds(cu_seqlens)
    read = read_slots(state_indices, num_valid, lens)
    spec = state_indices.dim() == 2
    init = initial_state_flags(has_initial_state, len(lens))
    dev = x.device

    y = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=dev)
    # Active rows, longest first: the rows with a token t are then always a prefix.
    rows = sorted((i for i in range(len(lens)) if read[i] != PAD_SLOT_ID), key=lambda i: -lens[i])
    if rows:
        xf, dtf = x.float(), dt.float()
        decay = torch.exp(dtf * A.float())                      # [T, H]
        xdt = xf * dtf[:, :, None]                              # [T, H, P]
        bh, ch = per_head(B, num_heads), per_head(C, num_heads)  # [T, H, N]
        skip = D.float()[:, None] * xf                          # [T, H, P]
        slots = torch.tensor([read[i] for i in rows], dtype=torch.long, device=dev)
        keep = torch.tensor([init[i] for i in rows], dtype=torch.bool, device=dev)
        # Every initial state is gathered before anything is written.
        state = gather_initial_states(ssm_state, slots, keep)  # [R, H, P, N]
        cols = state_indices[rows].tolist() if spec else None  # [R][K+1], rows in the order of `state`
        for t in range(lens[rows[0]]):
            n = sum(1 for i in rows if lens[i] > t)
            tok = torch.tensor([starts[i] + t for i in rows[:n]], dtype=torch.long, device=dev)
            s = state[:n]
            s.mul_(decay[tok][:, :, None, None])
            s.add_(xdt[tok][:, :, :, None] * bh[tok][:, :, None, :])
            y[tok] = (s * ch[tok][:, :, None, :]).sum(dim=-1) + skip[tok]
            if spec:
                write_token_states(ssm_state, s, cols, t)
        if not spec:
            ssm_state[slots] = state.to(ssm_state.dtype)
    return y.to(x.dtype)


def chunk_bounds(start: int, length: int, chunk_size: int) -> list[tuple[int, int]]:
    """The chunks of a row whose first token sits at absolute position ``start``: ``(s, e)`` offsets
    into the row, cut at every absolute multiple of ``chunk_size`` (the first chunk completes a
    partial one)."""
    bounds, s = [], 0
    while s < length:
        e = min(length, (start + s) // chunk_size * chunk_size + chunk_size - start)
        bounds.append((s, e))
        s = e
    return bounds


def ssd_chunk(state, x, dt, A, B, C):
    """One chunk of the SSD scan for one sequence, float32.

    state: [H, P, N] at the chunk start; x: [L, H, P]; dt: [L, H]; A: [H]; B, C: [L, H, N].
    Returns (y without the D term [L, H, P], the state after the chunk [H, P, N]).
    """
    length = x.shape[0]
    cum = torch.cumsum(dt * A[None, :], dim=0).t()               # [H, L] log decay from the chunk start
    xdt = (x * dt[:, :, None]).transpose(0, 1)                     # [H, L, P]
    bt, ct = B.transpose(0, 1), C.transpose(0, 1)                  # [H, L, N]
    pos = torch.arange(length, device=x.device)
    causal = pos[:, None] >= pos[None, :]
    seg = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf"))
    scores = (ct @ bt.transpose(1, 2)) * torch.exp(seg)            # [H, L, L]: (C_i . B_j) e^{cum_i - cum_j}
    y = scores @ xdt                                               # [H, L, P] intra-chunk
    y = y + torch.exp(cum)[:, :, None] * (ct @ state.transpose(1, 2))  # + e^{cum_i} C_i . S_0
    last = cum[:, -1:]                                             # [H, 1]
    decayed = xdt * torch.exp(last - cum)[:, :, None]              # [H, L, P]
    state = state * torch.exp(last)[:, :, None] + decayed.transpose(1, 2) @ bt   # [H, P, N]
    return y.transpose(0, 1), state


def naive_ssd_chunk_scan(
    x, dt, A, B, C, D, ssm_state, cu_seqlens, state_indices, has_initial_state, *,
    start_positions=None, chunk_size=128, block_size=None, block_state_indices=None,
):
    """Chunked SSD scan, one sequence at a time (same recurrence as the plain recurrent form with 1-D
    ``state_indices``; agrees with it within float tolerance). Chunks are cut at absolute multiples of
    ``chunk_size`` (row i starts at ``start_positions[i]``, 0 when None). With ``block_size``, the
    state after every absolute multiple ``b`` of it with ``start < b <= start + len`` is also
    written to ``ssm_state[block_state_indices[i, j]]`` (j-th such boundary of the row; PAD entries
    and j past the last column are not written).
    """
    check_ssd_chunk_scan_inputs(x, dt, A, B, C, D, ssm_state, cu_seqlens, state_indices, has_initial_state,
                                start_positions, chunk_size, block_size, block_state_indices)
    num_tokens, num_heads, head_dim = x.shape
    starts, lens = row_bounds(cu_seqlens)
    slots = state_indices.tolist()
    init = initial_state_flags(has_initial_state, len(lens))
    pos0 = [0] * len(lens) if start_positions is None else start_positions.tolist()
    blocks = None if block_state_indices is None else block_state_indices.tolist()
    af = A.float()
    y = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=x.device)
    for i, (bos, length) in enumerate(zip(starts, lens)):
        if length == 0 or slots[i] == PAD_SLOT_ID:
            continue
        state = ssm_state[slots[i]].float().clone()                 # [H, P, N]
        if not init[i]:
            state = torch.zeros_like(state)
        for s, e in chunk_bounds(pos0[i], length, chunk_size):
            # Fresh copies: a chunk's math sees the same shapes whatever the row's neighbours.
            a, b = bos + s, bos + e
            xc = x[a:b].float().clone()
            yc, state = ssd_chunk(state, xc, dt[a:b].float().clone(), af,
                                  per_head(B[a:b], num_heads).clone(), per_head(C[a:b], num_heads).clone())
            y[a:b] = yc + D.float()[None, :, None] * xc
            end = pos0[i] + e
            if blocks is not None and end % block_size == 0:
                j = end // block_size - pos0[i] // block_size - 1
                if j < len(blocks[i]) and blocks[i][j] != PAD_SLOT_ID:
                    ssm_state[blocks[i][j]] = state.to(ssm_state.dtype)
        ssm_state[slots[i]] = state.to(ssm_state.dtype)
    return y.to(x.dtype)
