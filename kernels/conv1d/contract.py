"""Input contracts of the causal conv1d ops (kernels/_contract.py), called first by both backends."""

from __future__ import annotations

from typing import NamedTuple

from kernels._contract import BOOL, FLOATS, INDEX, Contract

ACTIVATIONS = ("silu", None)


class ConvDims(NamedTuple):
    num_tokens: int
    channels: int
    width: int
    num_rows: int


def _check_common(c: Contract, x, weight, conv_state, cu_name, cu_seqlens, activation, bias) -> ConvDims:
    """Checks shared by both forms (``cu_name``: what the form calls its row offsets); binds T, C, W,
    L (state columns) and N."""
    c.tensor("x", x, FLOATS, "T, C")
    c.tensor("weight", weight, FLOATS, "C, W")
    c.at_least("weight", "W", 2)
    c.tensor("bias", bias, FLOATS, "C", optional=True)
    c.tensor("conv_state", conv_state, FLOATS, "S, C, L")
    width = c.sizes["W"]
    c.at_least("conv_state", "L", width - 1)
    c.offsets(cu_name, cu_seqlens)
    c.choice("activation", activation, ACTIVATIONS)
    return ConvDims(c.sizes["T"], c.sizes["C"], width, c.sizes["N"])


def check_conv1d_fn_inputs(x, weight, conv_state, cu_seqlens, state_indices, has_initial_state,
                           activation, bias=None) -> ConvDims:
    """The contract of ``causal_conv1d_fn`` (kernels/README.md)."""
    c = Contract("causal_conv1d_fn")
    dims = _check_common(c, x, weight, conv_state, "cu_seqlens", cu_seqlens, activation, bias)
    c.tensor("state_indices", state_indices, INDEX, "N")
    c.tensor("has_initial_state", has_initial_state, BOOL, "N", optional=True)
    return dims


def check_conv1d_update_inputs(x, weight, conv_state, query_start_loc, state_indices, num_valid,
                               activation, bias=None) -> ConvDims:
    """The contract of ``causal_conv1d_update`` (kernels/README.md); only column 0 of 2-D indices is read."""
    c = Contract("causal_conv1d_update")
    dims = _check_common(c, x, weight, conv_state, "query_start_loc", query_start_loc, activation, bias)
    c.tensor("state_indices", state_indices, INDEX, "N", "N, K+1")
    if state_indices.dim() == 2:
        c.at_least("state_indices", "K+1", 1)
    c.tensor("num_valid", num_valid, INDEX, "N", optional=True)
    return dims
