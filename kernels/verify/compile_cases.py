"""Real-shape compile cases for greedy verification (see kernels/compile_check.py): vocab 151936, K = 4."""

from __future__ import annotations

from kernels.compile_check import case


def compile_cases():
    from kernels.verify import triton_greedy_verify as tgv

    return [case("verify.greedy[V=151936,K=4]", tgv.greedy_verify_kernel,
                 types={"target_logits": "*fp32", "draft_tokens": "*i64", "num_draft_tokens": "*i32",
                        "cu_num_logits": "*i32", "output_tokens": "*i64", "num_valid": "*i32"},
                 constexprs={"K": 4, "BV": 1024}, representative=True)]
