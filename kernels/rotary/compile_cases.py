"""Real-shape compile cases for ``rotary_embedding`` (see kernels/compile_check.py): Qwen3-Next's gated
attention (head 256, rotary dim 64: a pass-through of 192) and a full-head RoPE of 128 (Llama, Qwen3), bf16
(heads and token count are runtime values)."""

from __future__ import annotations

from kernels.compile_check import case


def compile_cases():
    import triton

    from kernels.rotary import triton_rotary as tr

    return [
        case(f"rotary[D={d},rd={rd}]", tr.rotary_kernel,
             types={"x": "*bf16", "y": "*bf16", "positions": "*i64", "log2_theta": "fp32"},
             constexprs={"D": d, "HALF": rd // 2, "BHALF": rd // 2, "BH": tr.BH,
                         "BREST": triton.next_power_of_2(d - rd) if d > rd else 0},
             representative=d == 256)
        for d, rd in ((256, 64), (128, 128))
    ]
