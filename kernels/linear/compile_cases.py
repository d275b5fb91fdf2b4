"""Real-shape compile cases for the linear kernel (see kernels/compile_check.py).

The sizes (hidden 2048 and the projection widths) are runtime values; what is compiled is the tile
configuration, for bf16 weights and for float32 (IEEE, no TF32).
"""

from __future__ import annotations

from kernels.compile_check import case


def compile_cases():
    from kernels.linear import triton_linear as tl_

    return [case(f"linear[hidden=2048,{dtype}]", tl_.linear_kernel,
                 types={"x": f"*{dtype}", "w": f"*{dtype}", "y": f"*{dtype}"},
                 constexprs={"BM": tl_.BM, "BN": tl_.BN, "BK": tl_.BK, "MATMUL": matmul},
                 representative=dtype == "bf16")
            for dtype, matmul in (("bf16", "dot"), ("fp32", "dot_fp32"))]
