"""Real-shape compile cases for paged attention (see kernels/compile_check.py).

Qwen3-Next / Qwen3.5 full-attention layers per tensor-parallel rank: query heads grouped 8 to a KV
head (G = 8), head dim 256, KV-cache block sizes 16 to 64, up to 256 rows per step.
"""

from __future__ import annotations

from kernels.compile_check import case

BLOCK_SIZES = (16, 32, 64)


def compile_cases():
    from kernels.attention import triton_paged_attention as tpa

    cases = []
    for block_size in BLOCK_SIZES:
        for act, matmul in (("*bf16", "dot"), ("*fp32", "dot_fp32")):
            cases.append(case(
                f"attention.paged[G=8,D=256,block={block_size},{act[1:]}]", tpa.paged_attention_kernel,
                types={"q": act, "k_cache": act, "v_cache": act, "o": act, "query_start_loc": "*i32",
                       "seq_lens": "*i32", "block_table": "*i32", "scale": "fp32"},
                constexprs=tpa.launch_constexprs(8, 256, block_size, 256, matmul),
                representative=block_size == 64 and matmul == "dot"))
    return cases
