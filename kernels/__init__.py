"""Shared compute kernels: a torch reference and a Triton kernel per op (see kernels/README.md)."""

from kernels._contract import KernelInputError
from kernels.activation import relu2, silu_mul
from kernels.attention import paged_attention
from kernels.constants import PAD_SLOT_ID
from kernels.conv1d import causal_conv1d_fn, causal_conv1d_update
from kernels.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from kernels.gdn_gating import gdn_gating
from kernels.kv_cache import reshape_and_cache
from kernels.linear import linear
from kernels.mamba2 import selective_state_update, ssd_chunk_scan
from kernels.moe import fused_moe, moe_route, moe_route_sigmoid
from kernels.norm import gated_group_rms_norm, gated_rms_norm, rms_norm
from kernels.rotary import rotary_embedding
from kernels.verify import greedy_verify

__all__ = [
    "PAD_SLOT_ID",
    "KernelInputError",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "fused_moe",
    "fused_recurrent_gated_delta_rule",
    "gated_group_rms_norm",
    "gated_rms_norm",
    "gdn_gating",
    "greedy_verify",
    "linear",
    "moe_route",
    "moe_route_sigmoid",
    "paged_attention",
    "relu2",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "selective_state_update",
    "silu_mul",
    "ssd_chunk_scan",
]
