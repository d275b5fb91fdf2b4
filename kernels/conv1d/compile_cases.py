"""Real-shape compile cases for the causal conv1d (see kernels/compile_check.py).

Qwen3-Next / Qwen3.5 GDN layers per tensor-parallel rank: 2 * 16 * 128 + 32 * 128 = 8192 channels
(a runtime value), kernel width 4, conv-state windows for up to K = 4 speculative tokens, no bias.
Nemotron-3 Nano / Super Mamba2 layers: 6144 / 10240 channels with a bias (the channel count is a
runtime value; both are compiled to keep the shapes on record).
"""

from __future__ import annotations

import triton

from kernels.compile_check import case
from kernels.constants import PAD_SLOT_ID

WIDTH, MAX_SPEC = 4, 4


def compile_cases():
    from kernels.conv1d import triton_conv1d

    cases = []
    for update, channels, bias in ((False, 8192, False), (True, 8192, False), (False, 6144, True),
                                   (True, 6144, True), (False, 10240, True), (True, 10240, True)):
        cases.append(
            case(
                f"conv1d.{'update' if update else 'prefill'}[C={channels},W={WIDTH},K={MAX_SPEC}"
                f"{',bias' if bias else ''}]",
                triton_conv1d.causal_conv1d_fwd_kernel,
                types={
                    "x": "*bf16",
                    "weight": "*bf16",
                    **({"bias": "*bf16"} if bias else {}),
                    "out": "*bf16",
                    "conv_state": "*bf16",
                    "cu_seqlens": "*i32",
                    "state_indices": "*i32",
                    **({"num_valid": "*i32"} if update else {"has_initial_state": "*i1"}),
                },
                constexprs={
                    "W": WIDTH,
                    "BC": 128,
                    "BS": triton.next_power_of_2(WIDTH - 1 + MAX_SPEC),
                    "PAD": PAD_SLOT_ID,
                    "IS_UPDATE": update,
                    "SILU": True,
                    "HAS_INIT_FLAGS": not update,
                    "HAS_ACCEPTED": update,
                    "HAS_BIAS": bias,
                    **({} if bias else {"bias": None}),
                    **({"has_initial_state": None} if update else {"num_valid": None}),
                },
                representative=update and channels != 10240,
            )
        )
    return cases
