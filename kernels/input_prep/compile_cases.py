"""Compile cases for the async engine's step preparation (see kernels/compile_check.py):
K = 4, block 16..64."""

from __future__ import annotations

import triton

from kernels.compile_check import case
from kernels.constants import PAD_SLOT_ID


def compile_cases():
    from kernels.input_prep import triton_input_prep as tip

    cases = [
        case(
            f"input_prep.prepare_inputs[K=4,block={bs}]",
            tip.prepare_inputs_kernel,
            types={
                "idx_mapping": "*i32",
                "query_start_loc": "*i32",
                "is_decode": "*i1",
                "num_computed": "*i32",
                "last_sampled": "*i64",
                "draft_tokens": "*i64",
                "token_ids": "*i64",
                "block_table": "*i32",
                "input_ids": "*i64",
                "positions": "*i64",
                "seq_lens": "*i32",
                "slot_mapping": "*i64",
            },
            constexprs={"K": 4, "BLOCK_SIZE": bs, "BT": 128, "PAD_ID": PAD_SLOT_ID},
            representative=bs == 64,
        )
        for bs in (16, 64)
    ]
    cases.append(
        case(
            "input_prep.post_update[K=4]",
            tip.post_update_kernel,
            types={
                "idx_mapping": "*i32",
                "query_lens": "*i32",
                "num_draft_tokens": "*i32",
                "is_sampling": "*i1",
                "sampled": "*i64",
                "num_valid": "*i32",
                "num_computed": "*i32",
                "num_valid_state": "*i32",
                "last_sampled": "*i64",
                "token_ids": "*i64",
                "num_tokens": "*i32",
            },
            constexprs={"BW": triton.next_power_of_2(5)},
            representative=True,
        )
    )
    return cases
