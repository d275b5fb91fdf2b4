"""Real-shape compile case for ``relu2`` (see kernels/compile_check.py): Nemotron-3 Super's dense MLP
width, bf16 (the column count is a runtime value)."""

from __future__ import annotations

from kernels.compile_check import case


def compile_cases():
    from kernels.activation import triton_relu2

    return [
        case("activation.relu2[bf16]", triton_relu2.relu2_kernel, types={"x": "*bf16", "y": "*bf16"},
             constexprs={"BH": triton_relu2.BH}, representative=True),
    ]
