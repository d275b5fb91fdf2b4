"""Real-shape compile cases for the norms (see kernels/compile_check.py):
hidden 2048, GDN value heads of 128; Mamba2's gated group norm of Nemotron-3 Nano (groups of 512) and
Super (groups of 1024)."""

from __future__ import annotations

from kernels.compile_check import case


def compile_cases():
    from kernels.norm import triton_rms_norm as trn

    return [
        case("norm.rms_norm[H=2048]", trn.rms_norm_kernel,
             types={"x": "*bf16", "w": "*bf16", "y": "*bf16", "eps": "fp32"},
             constexprs={"H": 2048, "BH": 2048, "ZERO_CENTERED": True}, representative=True),
        case("norm.gated_rms_norm[Dv=128]", trn.gated_rms_norm_kernel,
             types={"x": "*bf16", "z": "*bf16", "w": "*fp32", "y": "*bf16", "eps": "fp32"},
             constexprs={"D": 128, "BD": 128, "ROUND_PRODUCT": False}, representative=True),
    ] + [
        case(f"norm.gated_group_rms_norm[{name},I={width},group={gs}]", trn.gated_group_rms_norm_kernel,
             types={"x": "*bf16", "z": "*bf16", "w": "*bf16", "y": "*bf16", "eps": "fp32"},
             constexprs={"GROUPS": width // gs, "GS": gs, "BG": gs}, representative=name == "super")
        for name, width, gs in (("nano", 4096, 512), ("super", 8192, 1024))
    ]
