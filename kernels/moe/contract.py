"""Input contracts of the MoE ops (kernels/_contract.py), called first by every implementation."""

from __future__ import annotations

from typing import NamedTuple

from kernels._contract import FLOATS, INDEX, Contract, describe, dtype_name


class MoeDims(NamedTuple):
    num_tokens: int
    hidden: int
    num_experts: int
    intermediate: int
    top_k: int


def check_moe_route_inputs(router_logits, top_k, renormalize) -> None:
    """The contract of ``moe_route`` (kernels/README.md)."""
    c = Contract("moe_route")
    c.tensor("router_logits", router_logits, FLOATS, "T, E")
    c.integer("top_k", top_k, 1, c.sizes["E"])
    c.flag("renormalize", renormalize)


ACTIVATIONS = ("silu", "relu2")


def check_moe_route_sigmoid_inputs(router_logits, correction_bias, top_k, n_group, topk_group, renormalize,
                                   routed_scaling_factor) -> tuple[int, int]:
    """The contract of ``moe_route_sigmoid`` (kernels/README.md); returns (T, E)."""
    c = Contract("moe_route_sigmoid")
    c.tensor("router_logits", router_logits, FLOATS, "T, E")
    c.tensor("correction_bias", correction_bias, FLOATS, "E")
    num_experts = c.sizes["E"]
    c.integer("n_group", n_group, 1, max(num_experts, 1))
    c.require(num_experts % n_group == 0, "n_group", f"a divisor of E = {num_experts}", describe(n_group))
    c.integer("topk_group", topk_group, 1, n_group)
    c.integer("top_k", top_k, 1, num_experts // n_group * topk_group)
    c.flag("renormalize", renormalize)
    c.number("routed_scaling_factor", routed_scaling_factor)
    return c.sizes["T"], num_experts


def check_fused_moe_inputs(x, w13, w2, topk_weights, topk_ids, activation="silu") -> MoeDims:
    """The contract of ``fused_moe`` (kernels/README.md)."""
    c = Contract("fused_moe")
    c.choice("activation", activation, ACTIVATIONS)
    c.tensor("x", x, FLOATS, "T, H")
    if activation == "relu2":
        c.tensor("w13", w13, FLOATS, "E, I, H")
        c.at_least("w13", "E", 1)
    else:
        c.tensor("w13", w13, FLOATS, "E, 2I, H")
        c.at_least("w13", "E", 1)
        two_i = c.sizes["2I"]
        c.require(two_i % 2 == 0, "w13", "a tensor with an even 2I (I gate rows, then I up rows)",
                  f"2I = {two_i}")
        c.bind("I", two_i // 2)
    c.tensor("w2", w2, FLOATS, "E, H, I")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != x.dtype:
            c.refuse(name, f"of x's dtype {dtype_name(x.dtype)}", describe(t))
    c.tensor("topk_ids", topk_ids, INDEX, "T, K")
    c.tensor("topk_weights", topk_weights, FLOATS, "T, K")
    s = c.sizes
    return MoeDims(s["T"], s["H"], s["E"], s["I"], s["K"])
