"""Real-size compile cases for the MoE Triton kernels (Qwen3-Next-80B-A3B per rank).

Plain data: each case names a ``@triton.jit`` function, its argument types (``triton.compile``
signature strings) and its constexpr values. ``compile_case(case, arch)`` compiles one for a GPU
target without a GPU (in a process where ``TRITON_INTERPRET`` is unset: interpreted kernels cannot
be compiled); the compiled kernel's ``metadata.shared`` is the shared memory it needs.

``python -m kernels.moe.compile_cases [--arch 80 90] [--match TEXT]`` compiles the cases and
prints one JSON line per case: name, arch, shared bytes, the limit, and whether it fits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kernels.moe.triton_moe import (
    BH,
    BK,
    BM,
    BN,
    moe_combine_kernel,
    moe_down_kernel,
    moe_gate_up_kernel,
)

# Qwen3-Next-80B-A3B: hidden 2048, routed expert width 512, 512 experts, 10 routed per token.
HIDDEN, MOE_INTERMEDIATE, NUM_EXPERTS, TOP_K = 2048, 512, 512, 10

# Shared memory per block available to a kernel (bytes): opt-in maximum per compute capability.
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


@dataclass(frozen=True)
class CompileCase:
    name: str
    kernel: Any  # the @triton.jit function
    signature: Mapping[str, str]  # argument -> "*bf16", "i32", ... or "constexpr" (read-only)
    constexprs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:  # the case tables stay read-only
        object.__setattr__(self, "signature", MappingProxyType(dict(self.signature)))
        object.__setattr__(self, "constexprs", MappingProxyType(dict(self.constexprs)))


def _cases() -> tuple[CompileCase, ...]:
    table = {"sorted_pairs": "*i32", "block_expert": "*i32", "block_start": "*i32", "block_end": "*i32"}
    sizes = {"num_pairs": "i32", "H": "i32", "I": "i32"}
    cases = []
    for dtype, matmul in (("bf16", "dot"), ("fp32", "dot_fp32")):
        cases.append(CompileCase(
            name=f"moe_gate_up-{dtype}-H{HIDDEN}-I{MOE_INTERMEDIATE}-E{NUM_EXPERTS}-K{TOP_K}",
            kernel=moe_gate_up_kernel,
            signature={"x": f"*{dtype}", "w13": f"*{dtype}", "act": f"*{dtype}", **table, **sizes,
                       "stride_xt": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_ap": "i32",
                       "TOP_K": "constexpr", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr",
                       "MATMUL": "constexpr"},
            constexprs={"TOP_K": TOP_K, "BM": BM, "BN": BN, "BK": BK, "MATMUL": matmul},
        ))
        cases.append(CompileCase(
            name=f"moe_down-{dtype}-H{HIDDEN}-I{MOE_INTERMEDIATE}-E{NUM_EXPERTS}-K{TOP_K}",
            kernel=moe_down_kernel,
            signature={"act": f"*{dtype}", "w2": f"*{dtype}", "y": f"*{dtype}", **table, **sizes,
                       "stride_ap": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_yp": "i32",
                       "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "MATMUL": "constexpr"},
            constexprs={"BM": BM, "BN": BN, "BK": BK, "MATMUL": matmul},
        ))
        cases.append(CompileCase(
            name=f"moe_combine-{dtype}-H{HIDDEN}-K{TOP_K}",
            kernel=moe_combine_kernel,
            signature={"y": f"*{dtype}", "topk_weights": "*fp32", "out": f"*{dtype}", "H": "i32",
                       "stride_yp": "i32", "stride_wt": "i32", "stride_ot": "i32",
                       "TOP_K": "constexpr", "BH": "constexpr"},
            constexprs={"TOP_K": TOP_K, "BH": BH},
        ))
    return tuple(cases)


CASES: tuple[CompileCase, ...] = _cases()


def compile_case(case: CompileCase, arch: int):
    """Compile ``case`` for CUDA compute capability ``arch`` (80, 90); no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = case.kernel
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise TypeError(f"{case.name}: the kernel is not a compilable JIT function (is TRITON_INTERPRET set?)")
    src = ASTSource(fn, signature=dict(case.signature), constexprs=dict(case.constexprs))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": case.num_warps, "num_stages": case.num_stages})


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m kernels.moe.compile_cases", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, nargs="+", default=sorted(SHARED_MEMORY_LIMIT))
    p.add_argument("--match", default="", help="only the cases whose name contains this text")
    args = p.parse_args(argv)
    ok = True
    for arch in args.arch:
        for case in CASES:
            if args.match not in case.name:
                continue
            kernel = compile_case(case, arch)
            shared, limit = kernel.metadata.shared, SHARED_MEMORY_LIMIT[arch]
            fits = shared <= limit and bool(kernel.asm.get("cubin"))
            ok &= fits
            print(json.dumps({"name": case.name, "arch": arch, "shared": shared, "limit": limit, "fits": fits}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["CASES", "SHARED_MEMORY_LIMIT", "CompileCase", "compile_case", "main"]
