"""The Mamba2 mixer of Nemotron-H (the ``M`` blocks).

Per token: ``in_proj`` -> z (I) | xBC (C = I + 2GN) | dt (Hm); xBC -> depthwise causal conv with bias
-> SiLU -> x (I) | B (GN) | C (GN); dt = softplus(dt + dt_bias) with no clamp; A = -exp(A_log); the
state S [Hm, P, N] in float32 follows S = exp(dt A) S + dt B x^T and y = S C + D x; then the gated
group RMSNorm (gate before the norm, groups of I/G channels) and ``out_proj``.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from refengine.forward_context import ForwardContext, RecurrentGroup, scatter_groups
from refengine.model.cache_specs import SLOT, WINDOW, RecurrentState
from refengine.model.layers import Linear, softplus
from refengine.model.nemotron_h.config import NemotronHConfig
from refengine.model.pieces import SplitMixer


class Conv1d(nn.Module):
    """Holds the depthwise conv weight (and bias); the conv itself runs in the kernels."""

    def __init__(self, channels: int, width: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, width))  # [C, W], tap W-1 = current token
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None  # [C]


class Mamba2Mixer(SplitMixer):
    """State per slot: ``ctx.states[cache_key] = (conv_state [S, C, W-1+K],
    ssm_state [S, Hm, P, N] fp32)``."""

    @staticmethod
    def cache_spec(cfg: NemotronHConfig, num_speculative_tokens: int) -> RecurrentState:
        """The conv window first (W-1 inputs plus K columns for a verify step), then the SSM state."""
        conv = (cfg.mamba_conv_dim, cfg.conv_kernel - 1 + num_speculative_tokens)
        ssm = (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size)
        return RecurrentState(shapes=(conv, ssm), fp32=(False, True), checkpoint=(WINDOW, SLOT))

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.num_heads = cfg.mamba_num_heads  # Hm
        self.head_dim = cfg.mamba_head_dim  # P
        self.state_size = cfg.ssm_state_size  # N
        self.n_groups = cfg.n_groups  # G
        self.inner = cfg.mamba_intermediate_size  # I = Hm * P
        self.conv_dim = cfg.mamba_conv_dim  # C = I + 2GN
        self.eps = cfg.layer_norm_epsilon
        self.chunk_size = cfg.chunk_size  # chunks of the opt-in chunked prefill, at absolute positions
        hidden = cfg.hidden_size
        self.in_proj = Linear(hidden, self.inner + self.conv_dim + self.num_heads)  # [I + C + Hm, H]
        self.conv1d = Conv1d(self.conv_dim, cfg.conv_kernel, cfg.use_conv_bias)  # weight [C, W], bias [C]
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))  # [Hm]
        self.A_log = nn.Parameter(torch.empty(self.num_heads))  # [Hm]
        self.D = nn.Parameter(torch.empty(self.num_heads))  # [Hm]
        self.norm = GroupGatedNorm(self.inner, self.inner // self.n_groups, self.eps)  # weight [I]
        self.out_proj = Linear(self.inner, hidden)  # [H, I]

    def pre(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Token-wise: in_proj split into z [T, I], xbc [T, C], dt [T, Hm] (views of one projection)."""
        proj = self.in_proj(x)  # [T, I + C + Hm]
        return tuple(torch.split(proj, [self.inner, self.conv_dim, self.num_heads], dim=-1))

    def core(self, parts: tuple, positions: torch.Tensor, ctx: ForwardContext,
             cache_key: int | str) -> tuple[torch.Tensor]:
        """The conv and the scan per group, over the step's recurrent metadata: y [T, I]."""
        z, xbc, dt = parts
        conv_state, ssm_state = ctx.states[cache_key]
        outputs = []
        for group, is_prefill in ((ctx.recurrent.prefill, True), (ctx.recurrent.decode, False)):
            if group is None or group.token_indices.numel() == 0:
                continue
            chunked = is_prefill and ctx.recurrent_prefill_chunked
            out = self._run_group(group, is_prefill, chunked, positions, xbc, dt, conv_state, ssm_state)
            outputs.append((group, out))  # [Tg, I]
        return (scatter_groups(outputs, z, (z.shape[0], self.inner)),)  # [T, I]

    def post(self, z, xbc, dt, y) -> torch.Tensor:  # y, z [T, I] -> [T, H]
        return self.out_proj(self.norm(y, z.contiguous()))

    def _run_group(
        self,
        group: RecurrentGroup,
        is_prefill: bool,
        chunked: bool,  # prefill in chunks (kernels.ssd_chunk_scan) instead of the recurrent form
        positions: torch.Tensor,  # [T] int64
        xbc: torch.Tensor,  # [T, C]
        dt_raw: torch.Tensor,  # [T, Hm]
        conv_state: torch.Tensor,  # [S, C, W-1+K]
        ssm_state: torch.Tensor,  # [S, Hm, P, N] float32
    ) -> torch.Tensor:  # [Tg, I]
        qsl = group.query_start_loc  # [Ng+1]
        slots = group.state_indices  # [Ng] or [Ng, K+1]
        if is_prefill and slots.dim() == 2:
            slots = slots[:, 0].contiguous()  # a prefill reads and writes its first slot only
        weight, bias = self.conv1d.weight, self.conv1d.bias
        h = group.gather(xbc)  # [Tg, C]
        if is_prefill:
            h = kernels.causal_conv1d_fn(h, weight, conv_state, qsl, slots, group.has_initial_state,
                                         bias=bias, activation="silu")
        else:
            h = kernels.causal_conv1d_update(h, weight, conv_state, qsl, slots, bias=bias, activation="silu",
                                             num_valid=group.num_valid)
        tg, gn = h.shape[0], self.n_groups * self.state_size
        xs, b, c = torch.split(h, [self.inner, gn, gn], dim=-1)
        xs = xs.reshape(tg, self.num_heads, self.head_dim).contiguous()  # [Tg, Hm, P]
        b = b.reshape(tg, self.n_groups, self.state_size).contiguous()  # [Tg, G, N]
        c = c.reshape(tg, self.n_groups, self.state_size).contiguous()  # [Tg, G, N]
        dt = softplus(group.gather(dt_raw).float() + self.dt_bias.float())  # [Tg, Hm] fp32, no clamp
        a = -torch.exp(self.A_log.float())  # [Hm] fp32
        if chunked:
            starts = _start_positions(group.gather(positions), qsl)  # [Ng] int32
            init = group.has_initial_state  # [Ng] bool
            y = kernels.ssd_chunk_scan(xs, dt, a, b, c, self.D, ssm_state, qsl, slots, init,
                                       start_positions=starts, chunk_size=self.chunk_size)
        elif is_prefill:
            y = kernels.selective_state_update(xs, dt, a, b, c, self.D, ssm_state, qsl, slots,
                                               has_initial_state=group.has_initial_state)
        else:
            num_valid = group.num_valid if slots.dim() == 2 else None
            y = kernels.selective_state_update(xs, dt, a, b, c, self.D, ssm_state, qsl, slots,
                                               num_valid=num_valid)
        return y.reshape(tg, self.inner)


class GroupGatedNorm(nn.Module):
    """Gated RMSNorm, gate before the norm, over groups of ``group_size`` channels; weight [I] as-is."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.group_size = group_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # [I]

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # y, z [T, I] -> [T, I]
        return kernels.gated_group_rms_norm(y, z, self.weight, self.eps, self.group_size)


def _start_positions(positions: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """positions [Tg] of a group's tokens, query_start_loc [Ng+1] -> int32 [Ng]: each row's first
    position (0 for an empty row)."""
    starts = query_start_loc[:-1].long()
    lens = query_start_loc[1:].long() - starts
    if positions.numel() == 0:
        return torch.zeros_like(starts, dtype=torch.int32)
    first = positions[starts.clamp(max=positions.numel() - 1)]
    return torch.where(lens > 0, first, 0).to(torch.int32)
