"""Plain-torch references for the gated delta rule (the op's specification; see README.md here).

Both references compute in float32 and are batch-invariant: a row's outputs and state writes do
not depend on which other rows share the call. The recurrent reference processes, for each token
index t, all rows that have a token t at once, using only elementwise ops and reductions over a
row's own head dimensions. The chunk reference runs each sequence on its own.
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
from kernels.gated_delta_rule.contract import check_chunk_inputs, check_recurrent_inputs

L2_NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dimension, in float32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2_NORM_EPS)


def prepare_qk(q, k, num_value_heads, scale, use_qk_l2norm):
    """Normalise and scale q/k in float32 and repeat key heads to value heads (GQA)."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * scale
    group = num_value_heads // q.shape[1]
    if group > 1:
        q = q.repeat_interleave(group, dim=1)
        k = k.repeat_interleave(group, dim=1)
    return q, k


def naive_recurrent_gated_delta_rule(
    q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, *,
    num_valid=None, has_initial_state=None, scale=None, use_qk_l2norm=True,
):
    """Token-by-token gated delta rule over a pooled, paged state (see kernels/README.md).

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv]; ssm_state: [S, Hv, Dk, Dv] (float32
    arithmetic whatever the dtypes), updated in place; cu_seqlens: [N+1]; state_indices: [N] (plain rows,
    final state written to idx[i]) or [N, K+1] (speculative rows: initial state from column
    num_valid[i] - 1, state after token t written to column t; PAD columns are not
    written). Rows whose read slot is PAD_SLOT_ID, and rows of length 0, read and write nothing.
    Returns o: [T, Hv, Dv] in v.dtype, zeros for tokens of skipped rows.
    """
    check_recurrent_inputs(q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, num_valid,
                           has_initial_state, scale, use_qk_l2norm)
    num_tokens, num_v_heads, dv = v.shape
    dk = q.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    starts, lens = row_bounds(cu_seqlens)
    read = read_slots(state_indices, num_valid, lens)
    spec = state_indices.dim() == 2
    init = initial_state_flags(has_initial_state, len(lens))

    o = torch.zeros(num_tokens, num_v_heads, dv, dtype=torch.float32, device=v.device)
    # Active rows, longest first: the rows with a token t are then always a prefix.
    rows = sorted((i for i in range(len(lens)) if read[i] != PAD_SLOT_ID), key=lambda i: -lens[i])
    if rows:
        qn, kn = prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm)
        decay = torch.exp(g.float())
        vf, bf = v.float(), beta.float()
        slots = torch.tensor([read[i] for i in rows], dtype=torch.long, device=v.device)
        keep = torch.tensor([init[i] for i in rows], dtype=torch.bool, device=v.device)
        # Gather every initial state before anything is written.
        state = gather_initial_states(ssm_state, slots, keep)  # [R, Hv, Dk, Dv]
        cols = state_indices[rows].tolist() if spec else None  # [R][K+1], rows in the order of `state`
        # Token t of every row gathered once, time-major ([L, R, ...]: step t reads contiguous rows; a
        # row shorter than L repeats its first token there, never read).
        length = lens[rows[0]]
        steps = torch.tensor([[starts[i] + (t if t < lens[i] else 0) for i in rows] for t in range(length)],
                             dtype=torch.long, device=v.device)  # [L, R]
        decays, keys, queries = decay[steps], kn[steps], qn[steps]
        values, betas = vf[steps], bf[steps]
        for t in range(length):
            n = sum(1 for i in rows if lens[i] > t)
            s = state[:n]
            s.mul_(decays[t, :n, :, None, None])
            k_t = keys[t, :n, :, :, None]                                         # [n, Hv, Dk, 1]
            delta = (values[t, :n] - (k_t * s).sum(dim=-2)) * betas[t, :n, :, None]  # [n, Hv, Dv]
            s.add_(k_t * delta[:, :, None, :])
            o[steps[t, :n]] = (queries[t, :n, :, :, None] * s).sum(dim=-2)
            if spec:
                write_token_states(ssm_state, s, cols, t)
        if not spec:
            ssm_state[slots] = state.to(ssm_state.dtype)
    return o.to(v.dtype)


def chunk_gated_delta_rule_dense(q, k, v, g, beta, state, chunk_size=64):
    """Chunked (WY/UT) gated delta rule over dense sequences; any leading dims are a batch.

    q, k: [..., L, Dk] (normalised, q scaled); v: [..., L, Dv]; g, beta: [..., L]; state:
    [..., Dk, Dv] float32. Returns (o [..., L, Dv], final state). Differentiable (the training
    forward of the default model runs through it).
    """
    *lead, length, dk = k.shape
    dv = v.shape[-1]
    pad = (-length) % chunk_size
    if pad:
        # Padded tokens have k = v = 0, beta = 0 and g = 0: they leave the state unchanged.
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    nc = (length + pad) // chunk_size
    q, k = q.reshape(*lead, nc, chunk_size, dk), k.reshape(*lead, nc, chunk_size, dk)
    v = v.reshape(*lead, nc, chunk_size, dv)
    g, beta = g.reshape(*lead, nc, chunk_size), beta.reshape(*lead, nc, chunk_size)

    g_cum = g.cumsum(dim=-1)                                      # log of gamma_t within the chunk
    pos = torch.arange(chunk_size, device=q.device)
    causal = pos[:, None] >= pos[None, :]
    strict = pos[:, None] > pos[None, :]
    diff = g_cum[..., :, None] - g_cum[..., None, :]              # log(gamma_i / gamma_j)
    decay = torch.exp(diff.masked_fill(~causal, float("-inf")))  # zero above the diagonal

    k_beta = k * beta[..., None]
    # (I + A) with A[i, j] = beta_i (k_i . k_j) gamma_i / gamma_j for j < i.
    a = (k_beta @ k.transpose(-1, -2)) * decay.masked_fill(~strict, 0.0)
    eye = torch.eye(chunk_size, device=q.device, dtype=q.dtype)
    system = a + eye
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * torch.exp(g_cum)[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay

    outs = []
    for c in range(nc):
        qc, kc, gc = q[..., c, :, :], k[..., c, :, :], g_cum[..., c, :]
        v_new = u[..., c, :, :] - w[..., c, :, :] @ state
        outs.append((qc * torch.exp(gc)[..., None]) @ state + qk[..., c, :, :] @ v_new)
        last = gc[..., -1:]
        k_decayed = kc * torch.exp(last - gc)[..., None]
        state = state * torch.exp(last)[..., None] + k_decayed.transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=-3).reshape(*lead, nc * chunk_size, dv)[..., :length, :]
    return o, state


def naive_chunk_gated_delta_rule(
    q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, has_initial_state, *,
    scale=None, use_qk_l2norm=True, chunk_size=64,
):
    """Chunked gated delta rule, one sequence at a time (same semantics as the plain recurrent
    form with 1-D ``state_indices``). Agrees with the recurrent reference within float tolerance.
    """
    check_chunk_inputs(q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, has_initial_state, scale,
                       use_qk_l2norm, chunk_size)
    num_tokens, num_v_heads, dv = v.shape
    dk = q.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    starts, lens = row_bounds(cu_seqlens)
    slots = state_indices.tolist()
    init = initial_state_flags(has_initial_state, len(lens))
    o = torch.zeros(num_tokens, num_v_heads, dv, dtype=torch.float32, device=v.device)
    for i, (bos, length) in enumerate(zip(starts, lens)):
        if length == 0 or slots[i] == PAD_SLOT_ID:
            continue
        eos = bos + length
        # Fresh copies: each sequence's math sees the same shapes and alignment whatever its
        # neighbours, so its result is bitwise the same alone or in a batch.
        qi, ki = prepare_qk(q[bos:eos], k[bos:eos], num_v_heads, scale, use_qk_l2norm)
        vi = v[bos:eos].float().clone()
        gi, bi = g[bos:eos].float().t().contiguous(), beta[bos:eos].float().t().contiguous()
        state = ssm_state[slots[i]].float().clone()
        if not init[i]:
            state = torch.zeros_like(state)
        oi, state = chunk_gated_delta_rule_dense(
            qi.transpose(0, 1).contiguous(), ki.transpose(0, 1).contiguous(),
            vi.transpose(0, 1).contiguous(), gi, bi, state, chunk_size)
        o[bos:eos] = oi.transpose(0, 1)
        ssm_state[slots[i]] = state.to(ssm_state.dtype)
    return o.to(v.dtype)
