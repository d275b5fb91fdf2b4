"""Shared compute kernels: a torch reference and a Triton kernel per op (see kernels/README.md)."""

from kernels._contract import KernelInputError
from kernels.attention import paged_attention
from kernels.constants import PAD_SLOT_ID
from kernels.conv1d import causal_conv1d_fn, causal_conv1d_update
from kernels.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from kernels.kv_cache import reshape_and_cache
from kernels.linear import linear
from kernels.moe import fused_moe, moe_route
from kernels.norm import gated_rms_norm, rms_norm
from kernels.verify import greedy_verify

__all__ = [
    "PAD_SLOT_ID",
    "KernelInputError",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "fused_moe",
    "fused_recurrent_gated_delta_rule",
    "gated_rms_norm",
    "greedy_verify",
    "linear",
    "moe_route",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
]
