"""Gated DeltaNet (linear attention) layer, held in the Qwen3.5 split projection layout."""

from __future__ import annotations

import torch
from torch import nn

import kernels
from refengine.forward_context import ForwardContext, RecurrentGroup, scatter_groups
from refengine.model.cache_specs import SLOT, WINDOW, RecurrentState
from refengine.model.layers import GatedRMSNorm, Linear
from refengine.model.pieces import SplitMixer
from refengine.model.qwen3_next.config import Qwen3NextConfig


class CausalConv1d(nn.Module):
    """Holds the depthwise conv weight; the conv itself runs in the kernels."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, width))  # [C, W], tap W-1 = current token


class GatedDeltaNet(SplitMixer):
    """One GDN mixer.

    Per token: qkv -> causal conv + SiLU -> q/k/v; gates g = -exp(A_log) * softplus(a + dt_bias) and
    beta = sigmoid(b) in float32; the gated delta rule; gated RMSNorm with z; out_proj.
    State per slot: ``ctx.states[cache_key] = (conv_state [S, C, W-1+K], ssm_state [S, Hv, Dk, Dv] fp32)``.
    """

    attr_name = "linear_attn"  # checkpoint prefix inside a decoder layer

    @staticmethod
    def cache_spec(cfg: Qwen3NextConfig, num_speculative_tokens: int) -> RecurrentState:
        """The conv window keeps W-1 inputs plus K columns, so a verify step can restart at any offset."""
        conv = (cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1 + num_speculative_tokens)
        ssm = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        return RecurrentState(shapes=(conv, ssm), fp32=(False, True), checkpoint=(WINDOW, SLOT))

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        self.num_k_heads = cfg.linear_num_key_heads  # Hk
        self.num_v_heads = cfg.linear_num_value_heads  # Hv
        self.head_k_dim = cfg.linear_key_head_dim  # Dk
        self.head_v_dim = cfg.linear_value_head_dim  # Dv
        self.key_dim = cfg.gdn_key_dim  # Hk * Dk
        self.value_dim = cfg.gdn_value_dim  # Hv * Dv
        hidden = cfg.hidden_size
        self.in_proj_qkv = Linear(hidden, cfg.gdn_conv_dim)  # [C, H], rows [q | k | v]
        self.in_proj_z = Linear(hidden, self.value_dim)  # [Hv*Dv, H]
        self.in_proj_b = Linear(hidden, self.num_v_heads)  # [Hv, H]
        self.in_proj_a = Linear(hidden, self.num_v_heads)  # [Hv, H]
        self.conv1d = CausalConv1d(cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim)  # weight [C, W]
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))  # [Hv]
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))  # [Hv]
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)  # weight [Dv]
        self.out_proj = Linear(self.value_dim, hidden)  # [H, Hv*Dv]

    def pre(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Token-wise: qkv [T, C], z [T, Hv, Dv], the gates g (<= 0) and beta [T, Hv] fp32."""
        num_tokens = x.shape[0]
        qkv = self.in_proj_qkv(x)  # [T, C]
        z = self.in_proj_z(x).view(num_tokens, self.num_v_heads, self.head_v_dim)  # [T, Hv, Dv]
        b = self.in_proj_b(x)  # [T, Hv]
        a = self.in_proj_a(x)  # [T, Hv]
        # The gates of every token at once (elementwise: a token's bits do not depend on its neighbours),
        # gathered per group in ``core``: one set of launches for both groups of a mixed step.
        g, beta = kernels.gdn_gating(self.A_log, a, self.dt_bias, b)  # [T, Hv] fp32: g <= 0, beta in (0, 1)
        return qkv, z, g, beta

    def core(self, parts: tuple, positions: torch.Tensor, ctx: ForwardContext,
             cache_key: int | str) -> tuple[torch.Tensor]:
        """The conv and the delta rule per group, over the step's recurrent metadata: core [T, Hv, Dv]."""
        qkv, _z, g, beta = parts
        conv_state, ssm_state = ctx.states[cache_key]
        outputs = []
        for group, is_prefill in ((ctx.recurrent.prefill, True), (ctx.recurrent.decode, False)):
            if group is None or group.token_indices.numel() == 0:
                continue
            out = self._run_group(
                group, is_prefill, ctx.recurrent_prefill_chunked, qkv, g, beta, conv_state, ssm_state
            )  # [Tg, Hv, Dv]
            outputs.append((group, out))
        shape = (qkv.shape[0], self.num_v_heads, self.head_v_dim)
        return (scatter_groups(outputs, qkv, shape),)  # [T, Hv, Dv]

    def post(self, qkv, z, g, beta, core) -> torch.Tensor:  # core, z [T, Hv, Dv] -> [T, H]
        y = self.norm(core, z)  # [T, Hv, Dv]
        return self.out_proj(y.reshape(core.shape[0], self.value_dim))

    def _run_group(
        self,
        group: RecurrentGroup,
        is_prefill: bool,
        chunked: bool,
        qkv: torch.Tensor,  # [T, C]
        g_all: torch.Tensor,  # [T, Hv] fp32, the gates
        beta_all: torch.Tensor,  # [T, Hv] fp32
        conv_state: torch.Tensor,  # [S, C, W-1+K]
        ssm_state: torch.Tensor,  # [S, Hv, Dk, Dv] float32
    ) -> torch.Tensor:
        qsl = group.query_start_loc  # [Ng+1]
        slots = group.state_indices  # [Ng] or [Ng, K+1]
        if is_prefill and slots.dim() == 2:
            slots = slots[:, 0].contiguous()  # a prefill reads and writes its first slot only
        weight = self.conv1d.weight  # [C, W]
        x = group.gather(qkv)  # [Tg, C]
        if is_prefill:
            x = kernels.causal_conv1d_fn(
                x, weight, conv_state, qsl, slots, group.has_initial_state, activation="silu"
            )
        else:
            x = kernels.causal_conv1d_update(
                x, weight, conv_state, qsl, slots, num_valid=group.num_valid, activation="silu"
            )
        tg = x.shape[0]
        q, k, v = torch.split(x, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(tg, self.num_k_heads, self.head_k_dim).contiguous()  # [Tg, Hk, Dk]
        k = k.reshape(tg, self.num_k_heads, self.head_k_dim).contiguous()  # [Tg, Hk, Dk]
        v = v.reshape(tg, self.num_v_heads, self.head_v_dim).contiguous()  # [Tg, Hv, Dv]

        g = group.gather(g_all)  # [Tg, Hv] fp32, <= 0 (contiguous)
        beta = group.gather(beta_all)  # [Tg, Hv] fp32

        if is_prefill and chunked:
            return kernels.chunk_gated_delta_rule(
                q, k, v, g, beta, ssm_state, qsl, slots, group.has_initial_state, use_qk_l2norm=True
            )
        if is_prefill:
            return kernels.fused_recurrent_gated_delta_rule(
                q, k, v, g, beta, ssm_state, qsl, slots, has_initial_state=group.has_initial_state,
                use_qk_l2norm=True,
            )
        num_valid = group.num_valid if slots.dim() == 2 else None
        return kernels.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, ssm_state, qsl, slots, num_valid=num_valid, use_qk_l2norm=True
        )
