"""Real-size compile cases for the MoE Triton kernels (see kernels/compile_check.py).

Qwen3-Next-80B-A3B per rank: hidden 2048, routed expert width 512, 512 experts, 10 routed per token;
bf16 activations and the float32 (conformance) path. Nemotron-3 relu² experts: Nano (hidden 2688,
width 1856, 128 experts, top-6) and Super (latent 1024, width 2688, 512 experts, top-22), bf16.
"""

from __future__ import annotations

from kernels.compile_check import case

HIDDEN, MOE_INTERMEDIATE, NUM_EXPERTS, TOP_K = 2048, 512, 512, 10


def compile_cases():
    from kernels.moe.triton_moe import BH, BK, BM, BN, moe_combine_kernel, moe_down_kernel, moe_gate_up_kernel

    table = {"sorted_pairs": "*i32", "block_expert": "*i32", "block_start": "*i32", "block_end": "*i32"}
    cases = []
    for dtype, matmul in (("bf16", "dot"), ("fp32", "dot_fp32")):
        shape = f"H={HIDDEN},I={MOE_INTERMEDIATE},E={NUM_EXPERTS},K={TOP_K},{dtype}"
        cases += [
            case(f"moe.gate_up[{shape}]", moe_gate_up_kernel,
                 types={"x": f"*{dtype}", "w13": f"*{dtype}", "act": f"*{dtype}", **table},
                 constexprs={"TOP_K": TOP_K, "BM": BM, "BN": BN, "BK": BK, "MATMUL": matmul, "RELU2": False},
                 representative=dtype == "bf16"),
            case(f"moe.down[{shape}]", moe_down_kernel,
                 types={"act": f"*{dtype}", "w2": f"*{dtype}", "y": f"*{dtype}", **table},
                 constexprs={"BM": BM, "BN": BN, "BK": BK, "MATMUL": matmul}, representative=dtype == "bf16"),
            case(f"moe.combine[H={HIDDEN},K={TOP_K},{dtype}]", moe_combine_kernel,
                 types={"y": f"*{dtype}", "topk_weights": "*fp32", "out": f"*{dtype}"},
                 constexprs={"TOP_K": TOP_K, "BH": BH}, representative=dtype == "bf16"),
        ]
    for name, hidden, width, experts, top_k in (("nano", 2688, 1856, 128, 6), ("super", 1024, 2688, 512, 22)):
        shape = f"{name},H={hidden},I={width},E={experts},K={top_k},bf16"
        cases += [
            case(f"moe.up_relu2[{shape}]", moe_gate_up_kernel,
                 types={"x": "*bf16", "w13": "*bf16", "act": "*bf16", **table},
                 constexprs={"TOP_K": top_k, "BM": BM, "BN": BN, "BK": BK, "MATMUL": "dot", "RELU2": True},
                 representative=name == "nano"),
            case(f"moe.combine[{name},H={hidden},K={top_k},bf16]", moe_combine_kernel,
                 types={"y": "*bf16", "topk_weights": "*fp32", "out": "*bf16"},
                 constexprs={"TOP_K": top_k, "BH": BH}),
        ]
    return cases
