"""Real-shape compile cases for the KV-cache writes (see kernels/compile_check.py).

Qwen3-Next / Qwen3.5 per tensor-parallel rank: 2 KV heads of dim 256, block sizes 16 to 64, up to 256 rows.
"""

from __future__ import annotations

from kernels.compile_check import case
from kernels.constants import PAD_SLOT_ID


def compile_cases():
    from kernels.kv_cache import triton_kv_cache as tkv

    cases = []
    for block_size in (16, 32, 64):
        cases.append(
            case(
                f"kv_cache.reshape_and_cache[HkvD=512,block={block_size}]",
                tkv.reshape_and_cache_kernel,
                types={
                    "k": "*bf16",
                    "v": "*bf16",
                    "k_cache": "*bf16",
                    "v_cache": "*bf16",
                    "slot_mapping": "*i64",
                },
                constexprs={"BLOCK_SIZE": block_size, "HD": 512, "BHD": 512, "PAD_ID": PAD_SLOT_ID},
                representative=block_size == 64,
            )
        )
    return cases
