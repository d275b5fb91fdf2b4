"""Plain-torch Mamba2 / Nemotron-H ops with the call shapes of their kernels.

Until ``kernels`` provides them, the model calls these. Every op is batch-invariant: rows are
computed one at a time (or elementwise), and every reduction runs over a fixed axis of one row.

``selective_state_update`` keeps the recurrent-state slot contract of
``kernels.fused_recurrent_gated_delta_rule`` (refengine/README.md, contract 1): a plain row reads
and writes its one slot (zeros in when ``has_initial_state`` is False); a speculative row with slots
s_0..s_K reads ``s_{a-1}`` (``a = num_accepted_tokens``) and writes the state after token j into s_j.
"""

from __future__ import annotations

import torch

import kernels
from kernels.constants import PAD_SLOT_ID
from refengine.model.layers import silu


def selective_state_update(
    x: torch.Tensor,  # [T, Hm, P]
    dt: torch.Tensor,  # [T, Hm] float32, post-softplus
    A: torch.Tensor,  # [Hm] float32, -exp(A_log)
    B: torch.Tensor,  # [T, G, N]
    C: torch.Tensor,  # [T, G, N]
    D: torch.Tensor,  # [Hm]
    ssm_state: torch.Tensor,  # [S, Hm, P, N] float32, in place
    cu_seqlens: torch.Tensor,  # [R+1] int32
    state_indices: torch.Tensor,  # [R] or [R, K+1] int32
    *,
    num_accepted_tokens: torch.Tensor | None = None,  # [R] int32, speculative rows only
    has_initial_state: torch.Tensor | None = None,  # [R] bool; None: every row has one
) -> torch.Tensor:  # y [T, Hm, P] in x.dtype
    """Per token, in float32: S = exp(dt A) S + (dt B) x^T, y = S C + D x (the state read after the
    update), head h reading group h // (Hm / G)."""
    num_heads, groups = x.shape[1], B.shape[1]
    per_group = num_heads // groups
    a32 = A.float()[:, None, None]  # [Hm, 1, 1]
    d32 = D.float()[:, None]  # [Hm, 1]
    b_all = B.float().repeat_interleave(per_group, dim=1)  # [T, Hm, N]
    c_all = C.float().repeat_interleave(per_group, dim=1)  # [T, Hm, N]
    x32, dt32 = x.float(), dt.float()
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    cu = cu_seqlens.tolist()
    speculative = state_indices.dim() == 2
    slots = state_indices.tolist()
    accepted = [1] * len(slots) if num_accepted_tokens is None else num_accepted_tokens.tolist()
    initial = [True] * len(slots) if has_initial_state is None else has_initial_state.tolist()
    for i, row_slots in enumerate(slots):
        bos, eos = cu[i], cu[i + 1]
        first = row_slots[0] if speculative else row_slots
        if eos == bos or first == PAD_SLOT_ID:
            continue
        read = row_slots[accepted[i] - 1] if speculative else row_slots
        if initial[i]:
            state = ssm_state[read].clone()  # [Hm, P, N]
        else:
            state = torch.zeros(ssm_state.shape[1:], dtype=torch.float32, device=x.device)
        for j, t in enumerate(range(bos, eos)):
            decay = torch.exp(dt32[t][:, None, None] * a32)  # [Hm, 1, 1]
            db = dt32[t][:, None] * b_all[t]  # [Hm, N]
            state = state * decay + x32[t][:, :, None] * db[:, None, :]
            y[t] = (state * c_all[t][:, None, :]).sum(-1) + d32 * x32[t]
            if speculative:
                ssm_state[row_slots[j]] = state
        if not speculative:
            ssm_state[row_slots] = state
    return y.to(x.dtype)


def causal_conv1d_bias_fn(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, W]
    bias: torch.Tensor | None,  # [C]
    conv_state: torch.Tensor,  # [S, C, W-1+K], in place
    cu_seqlens: torch.Tensor,  # [R+1] int32
    state_indices: torch.Tensor,  # [R] int32
    has_initial_state: torch.Tensor | None,  # [R] bool
) -> torch.Tensor:  # [T, C], silu(conv + bias)
    """``kernels.causal_conv1d_fn`` (window contract unchanged) with a bias added before the SiLU."""
    out = kernels.causal_conv1d_fn(x, weight, conv_state, cu_seqlens, state_indices, has_initial_state,
                                   activation=None)
    return _bias_silu(out, bias)


def causal_conv1d_bias_update(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, W]
    bias: torch.Tensor | None,  # [C]
    conv_state: torch.Tensor,  # [S, C, W-1+K], in place
    query_start_loc: torch.Tensor,  # [R+1] int32
    state_indices: torch.Tensor,  # [R] or [R, K+1] int32
    num_accepted_tokens: torch.Tensor | None,  # [R] int32
) -> torch.Tensor:  # [T, C], silu(conv + bias)
    """``kernels.causal_conv1d_update`` (window read at a-1) with a bias added before the SiLU."""
    out = kernels.causal_conv1d_update(x, weight, conv_state, query_start_loc, state_indices,
                                       num_accepted_tokens=num_accepted_tokens, activation=None)
    return _bias_silu(out, bias)


def _bias_silu(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    acc = out.float() if bias is None else out.float() + bias.float()
    return silu(acc).to(out.dtype)


def gated_group_rms_norm(
    y: torch.Tensor,  # [T, I]
    z: torch.Tensor,  # [T, I]
    weight: torch.Tensor,  # [I]
    eps: float,
    group_size: int,  # I / G channels per group
) -> torch.Tensor:  # [T, I] in y.dtype
    """Gate before the norm: h = y * silu(z) in float32, RMS-normalised per group of ``group_size``
    channels, cast to y.dtype, then times the weight (used as-is)."""
    t, width = y.shape
    h = y.float() * silu(z.float())
    h = h.view(t, width // group_size, group_size)
    h = h * torch.rsqrt((h * h).mean(dim=-1, keepdim=True) + eps)
    return (weight * h.view(t, width).to(y.dtype)).to(y.dtype)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x) ** 2, elementwise."""
    r = torch.relu(x)
    return r * r


def nemotron_route(
    logits: torch.Tensor,  # [T, E] float32 router logits
    correction_bias: torch.Tensor,  # [E] float32
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # topk_weights [T, K] float32, topk_ids [T, K] int32
    """Sigmoid scores; experts chosen on score + correction bias, within the ``topk_group`` groups
    whose two best biased scores sum highest; weights are the unbiased scores of the chosen experts,
    renormalised (+1e-20) when asked, times ``scaling``."""
    scores = 1.0 / (1.0 + torch.exp(-logits.float()))  # [T, E]
    choice = scores + correction_bias.float()
    t, experts = choice.shape
    if n_group > 1:
        grouped = choice.view(t, n_group, experts // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, torch.topk(group_scores, k=topk_group, dim=-1)[1], True)
        mask = keep[:, :, None].expand(t, n_group, experts // n_group).reshape(t, experts)
        choice = choice.masked_fill(~mask, float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1)[1]  # [T, K]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids.to(torch.int32)


def relu2_experts(
    x: torch.Tensor,  # [T, L]
    w1: torch.Tensor,  # [E, Ie, L] (up_proj)
    w2: torch.Tensor,  # [E, L, Ie] (down_proj)
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int32
) -> torch.Tensor:  # [T, L] in x.dtype
    """out[t] = sum over slots k (in order) of w[t, k] * down_e(relu2(up_e(x[t]))), e = ids[t, k]."""
    t, k = topk_ids.shape
    y = x.new_zeros(t, k, x.shape[1])  # per (token, slot) expert output
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        y[tok, slot] = kernels.linear(relu2(kernels.linear(x[tok], w1[e])), w2[e])
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    weights = topk_weights.float()
    for s in range(k):  # fixed slot order
        out += weights[:, s, None] * y[:, s].float()
    return out.to(x.dtype)
