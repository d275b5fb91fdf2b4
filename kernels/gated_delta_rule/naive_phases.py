"""Plain-torch references of the five phases of the chunked gated delta rule (each phase's
specification; buffers and chunk slots in phase_contract.py, algebra in README.md).

Each reference loops over the chunks in Python and computes in float32; they exist to pin down what
each Triton phase computes, so they favour plainness over speed. Chained, they give the chunked op
(``compose`` below), which the tests hold against ``naive_chunk_gated_delta_rule``.
"""

from __future__ import annotations

import torch

from kernels.constants import PAD_SLOT_ID
from kernels.gated_delta_rule.naive import L2_NORM_EPS
from kernels.gated_delta_rule.phase_contract import (
    check_cumsum_inputs,
    check_output_inputs,
    check_solve_inputs,
    check_state_inputs,
    check_wy_inputs,
)


def chunks(cu_seqlens: torch.Tensor, chunk_size: int):
    """``(row, slot, first token, end token)`` of every chunk of every row, in order."""
    cu = cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        for c, t0 in enumerate(range(cu[i], cu[i + 1], chunk_size)):
            yield i, cu[i] // chunk_size + i + c, t0, min(t0 + chunk_size, cu[i + 1])


def _value_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """``[L, Hk, D]`` -> ``[Hv, L, D]`` float32, key head ``h // (Hv // Hk)`` for value head h."""
    return x.float().repeat_interleave(hv // x.shape[1], dim=1).transpose(0, 1)


def _inv_norm(x: torch.Tensor, use_qk_l2norm: bool) -> torch.Tensor:
    """``1 / sqrt(|x|^2 + eps)`` over the last dimension (``[..., 1]``), or ones."""
    if not use_qk_l2norm:
        return torch.ones_like(x[..., :1])
    return 1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_NORM_EPS)


def _decay(gc: torch.Tensor, strict: bool) -> torch.Tensor:
    """``exp(gc_i - gc_j)`` on the lower triangle (strictly when ``strict``), zeros above; gc ``[Hv, L]``."""
    n = gc.shape[-1]
    lower = torch.ones(n, n, dtype=torch.bool, device=gc.device).tril(-1 if strict else 0)
    return torch.exp((gc[:, :, None] - gc[:, None, :]).masked_fill(~lower, float("-inf")))


def chunk_cumsum(g, cu_seqlens, chunk_size):
    """Phase 1: ``gc [T, Hv]`` float32, the running sum of ``g`` inside each chunk."""
    check_cumsum_inputs(g, cu_seqlens, chunk_size)
    gc = torch.zeros(g.shape, dtype=torch.float32, device=g.device)
    for _, _, t0, t1 in chunks(cu_seqlens, chunk_size):
        gc[t0:t1] = g[t0:t1].float().cumsum(0)
    return gc


def chunk_solve(k, beta, gc, cu_seqlens, chunk_size, use_qk_l2norm=True):
    """Phase 2: ``(a_inv [T, Hv, BT], rk [T, Hv])``: per chunk ``(I + A)^-1`` with
    ``A[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j) / (|k_i| |k_j|)`` for ``j < i`` (the norms with
    ``use_qk_l2norm``), row i at token ``c0 + i``; and ``1 / |k_t|``."""
    check_solve_inputs(k, beta, gc, cu_seqlens, chunk_size, use_qk_l2norm)
    num_tokens, hv = gc.shape
    a_inv = torch.zeros(num_tokens, hv, chunk_size, dtype=torch.float32, device=k.device)
    rk = torch.zeros(num_tokens, hv, dtype=torch.float32, device=k.device)
    for _, _, t0, t1 in chunks(cu_seqlens, chunk_size):
        kh = _value_heads(k[t0:t1], hv)                                   # [Hv, L, Dk]
        r = _inv_norm(kh, use_qk_l2norm)                                  # [Hv, L, 1]
        kn = kh * r
        b = beta[t0:t1].float().t()                                       # [Hv, L]
        a = b[:, :, None] * (kn @ kn.transpose(1, 2)) * _decay(gc[t0:t1].t(), strict=True)
        eye = torch.eye(t1 - t0, device=k.device).expand_as(a)
        inv = torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)
        a_inv[t0:t1, :, : t1 - t0] = inv.transpose(0, 1)
        rk[t0:t1] = r[..., 0].t()
    return a_inv, rk


def chunk_wy(k, v, beta, gc, a_inv, rk, cu_seqlens, chunk_size):
    """Phase 3: ``(w [T, Hv, Dk], u [T, Hv, Dv])`` with, per chunk, ``w = a_inv diag(beta exp(gc) rk) K``
    and ``u = a_inv diag(beta) V``."""
    check_wy_inputs(k, v, beta, gc, a_inv, rk, cu_seqlens, chunk_size)
    num_tokens, hv, dv = v.shape
    w = torch.zeros(num_tokens, hv, k.shape[-1], dtype=torch.float32, device=k.device)
    u = torch.zeros(num_tokens, hv, dv, dtype=torch.float32, device=k.device)
    for _, _, t0, t1 in chunks(cu_seqlens, chunk_size):
        t_inv = a_inv[t0:t1, :, : t1 - t0].transpose(0, 1)                # [Hv, L, L]
        b = beta[t0:t1].float().t()[:, :, None]                           # [Hv, L, 1]
        scale = b * torch.exp(gc[t0:t1].t())[:, :, None] * rk[t0:t1].t()[:, :, None]
        w[t0:t1] = (t_inv @ (_value_heads(k[t0:t1], hv) * scale)).transpose(0, 1)
        u[t0:t1] = (t_inv @ (v[t0:t1].float().transpose(0, 1) * b)).transpose(0, 1)
    return w, u


def chunk_state(k, w, u, gc, rk, ssm_state, cu_seqlens, state_indices, has_initial_state, chunk_size):
    """Phase 4, the sequential one: ``(h [C, Hv, Dk, Dv], v' [T, Hv, Dv])``. Per row with a state slot,
    from ``S = ssm_state[idx]`` (zeros where ``has_initial_state`` is False), chunk by chunk:
    ``h[slot] = S``; ``v' = u - w S``; ``S = exp(gc_last) S + (K diag(rk exp(gc_last - gc)))^T v'``.
    The row's final ``S`` is written to ``ssm_state[idx]``."""
    check_state_inputs(k, w, u, gc, rk, ssm_state, cu_seqlens, state_indices, has_initial_state, chunk_size)
    num_tokens, hv, dv = u.shape
    dk = k.shape[-1]
    h = torch.zeros(num_tokens // chunk_size + len(state_indices), hv, dk, dv, device=k.device)
    vnew = u.clone()
    slots = state_indices.tolist()
    init = [True] * len(slots) if has_initial_state is None else has_initial_state.tolist()
    states = {}
    for i, slot, t0, t1 in chunks(cu_seqlens, chunk_size):
        if slots[i] == PAD_SLOT_ID:
            continue
        if i not in states:
            s0 = ssm_state[slots[i]].float()
            states[i] = s0.clone() if init[i] else torch.zeros_like(s0)
        s = states[i]                                                     # [Hv, Dk, Dv]
        h[slot] = s
        v_c = u[t0:t1].transpose(0, 1) - w[t0:t1].transpose(0, 1) @ s     # [Hv, L, Dv]
        vnew[t0:t1] = v_c.transpose(0, 1)
        g_c = gc[t0:t1].t()                                               # [Hv, L]
        last = g_c[:, -1:]
        kd = _value_heads(k[t0:t1], hv) * (rk[t0:t1].t() * torch.exp(last - g_c))[:, :, None]
        states[i] = s * torch.exp(last)[:, :, None] + kd.transpose(1, 2) @ v_c
    for i, s in states.items():
        ssm_state[slots[i]] = s.to(ssm_state.dtype)
    return h, vnew


def chunk_output(q, k, vnew, gc, h, cu_seqlens, state_indices, chunk_size, scale, use_qk_l2norm=True,
                 out_dtype=None):
    """Phase 5: ``o [T, Hv, Dv]`` in ``out_dtype`` (default ``vnew``'s). Per chunk of a row with a state
    slot, with ``q^ = scale q / |q|`` and ``k^ = k / |k|`` (plain q, k without the L2 norm):
    ``o = diag(exp(gc)) Q^ h[slot] + (Q^ K^T * exp(gc_i - gc_j), j <= i) v'``; zeros elsewhere."""
    check_output_inputs(q, k, vnew, gc, h, cu_seqlens, state_indices, chunk_size, scale, use_qk_l2norm)
    num_tokens, hv, dv = vnew.shape
    o = torch.zeros(num_tokens, hv, dv, dtype=torch.float32, device=q.device)
    slots = state_indices.tolist()
    for i, slot, t0, t1 in chunks(cu_seqlens, chunk_size):
        if slots[i] == PAD_SLOT_ID:
            continue
        qh, kh = _value_heads(q[t0:t1], hv), _value_heads(k[t0:t1], hv)
        qn = qh * _inv_norm(qh, use_qk_l2norm) * scale
        kn = kh * _inv_norm(kh, use_qk_l2norm)
        g_c = gc[t0:t1].t()
        inter = (qn * torch.exp(g_c)[:, :, None]) @ h[slot]
        intra = ((qn @ kn.transpose(1, 2)) * _decay(g_c, strict=False)) @ vnew[t0:t1].transpose(0, 1)
        o[t0:t1] = (inter + intra).transpose(0, 1)
    return o.to(out_dtype or vnew.dtype)


def compose(q, k, v, g, beta, ssm_state, cu_seqlens, state_indices, has_initial_state, *, scale=None,
            use_qk_l2norm=True, chunk_size=64):
    """The five references chained: the chunked op (``chunk_gated_delta_rule``'s arguments)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    gc = chunk_cumsum(g, cu_seqlens, chunk_size)
    a_inv, rk = chunk_solve(k, beta, gc, cu_seqlens, chunk_size, use_qk_l2norm)
    w, u = chunk_wy(k, v, beta, gc, a_inv, rk, cu_seqlens, chunk_size)
    h, vnew = chunk_state(k, w, u, gc, rk, ssm_state, cu_seqlens, state_indices, has_initial_state,
                          chunk_size)
    return chunk_output(q, k, vnew, gc, h, cu_seqlens, state_indices, chunk_size, scale, use_qk_l2norm,
                        out_dtype=v.dtype)
