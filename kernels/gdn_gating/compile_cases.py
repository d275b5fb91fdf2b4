"""Real-shape compile case for ``gdn_gating`` (see kernels/compile_check.py): Qwen3-Next's 32 value heads,
bf16 projections, float32 parameters (the token count is a runtime value)."""

from __future__ import annotations

from kernels.compile_check import case


def compile_cases():
    from kernels.gdn_gating import triton_gdn_gating as tg

    return [
        case("gdn_gating[Hv=32]", tg.gdn_gating_kernel,
             types={"a_log": "*fp32", "a": "*bf16", "dt_bias": "*fp32", "b": "*bf16", "g": "*fp32",
                    "beta": "*fp32"},
             constexprs={"HV": 32, "BHV": 32, "BT": tg.BT, "THRESHOLD": tg.SOFTPLUS_THRESHOLD},
             representative=True),
    ]
