"""Real-shape compile cases for ``relu2`` and ``silu_mul`` (see kernels/compile_check.py), bf16 (the column
count is a runtime value: Nemotron-3 Super's dense MLP width, a Qwen3 MLP's)."""

from __future__ import annotations

from kernels.compile_check import case


def compile_cases():
    from kernels.activation import triton_relu2, triton_silu_mul

    return [
        case("activation.relu2[bf16]", triton_relu2.relu2_kernel, types={"x": "*bf16", "y": "*bf16"},
             constexprs={"BH": triton_relu2.BH}, representative=True),
        case("activation.silu_mul[bf16]", triton_silu_mul.silu_mul_kernel,
             types={"gate": "*bf16", "up": "*bf16", "y": "*bf16"}, constexprs={"BI": triton_silu_mul.BI},
             representative=True),
    ]
