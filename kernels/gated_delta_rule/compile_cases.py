"""Real-shape compile cases for the gated delta rule kernels (see kernels/compile_check.py).

Qwen3-Next-80B and Qwen3.5 per tensor-parallel rank: Hk = 16 key heads, Hv = 32 or 64 value heads,
Dk = Dv = 128 (and 256 for the chunked prefill), bf16 activations, float32 state pool, verify rows of
1 + K tokens (K <= 4; the token count is a runtime value, so one compiled kernel serves every K).
"""

from __future__ import annotations

from kernels.compile_check import case
from kernels.constants import PAD_SLOT_ID

HK = 16
ACT = "*bf16"


def _recurrent(hv: int, d: int, spec: bool, representative: bool):
    from kernels.gated_delta_rule import triton_recurrent

    cfg = triton_recurrent.launch_config(d, d)
    return case(
        f"gdn.recurrent[Hv={hv},D={d},{'verify' if spec else 'decode'}]",
        triton_recurrent.fused_recurrent_gated_delta_rule_fwd_kernel,
        types={
            "q": ACT,
            "k": ACT,
            "v": ACT,
            "o": ACT,
            "g": "*fp32",
            "beta": "*fp32",
            "ssm_state": "*fp32",
            "cu_seqlens": "*i32",
            "state_indices": "*i32",
            "has_initial_state": "*i1",
            "scale": "fp32",
            **({"num_valid": "*i32"} if spec else {}),
        },
        constexprs={
            "HK": HK,
            "HV": hv,
            "DK": d,
            "DV": d,
            "BK": cfg["BK"],
            "BV": cfg["BV"],
            "PAD": PAD_SLOT_ID,
            "USE_QK_L2NORM": True,
            "IS_SPEC": spec,
            "HAS_INIT_FLAGS": True,
            **({} if spec else {"num_valid": None}),
        },
        num_warps=cfg["num_warps"],
        representative=representative,
    )


def _chunk(hv: int, d: int, representative: bool):
    from kernels.gated_delta_rule import triton_chunk as tc

    cfg = tc.launch_config(d, d, 64)
    shape = f"Hv={hv},D={d}"
    common = {"HK": HK, "HV": hv, "DK": d, "DV": d, "BT": cfg["BT"], "BK": cfg["BK"], "NK": cfg["NK"],
              "PAD": PAD_SLOT_ID, "DOT_PRECISION": "tf32x3"}
    f32 = "*fp32"
    return [
        case(
            f"gdn.chunk_wy[{shape}]",
            tc.chunk_gdn_wy_kernel,
            types={
                "k": ACT,
                "v": ACT,
                "g": f32,
                "beta": f32,
                "w_buf": f32,
                "u_buf": f32,
                "c_buf": f32,
                "rk_buf": f32,
                "cu_seqlens": "*i32",
                "state_indices": "*i32",
            },
            constexprs={**common, "BV": cfg["wy"]["BV"], "BN": 64, "USE_QK_L2NORM": True, "LOWP_QK": True},
            num_warps=cfg["wy"]["num_warps"],
            num_stages=cfg["wy"]["num_stages"],
            representative=representative,
        ),
        case(
            f"gdn.chunk_state[{shape}]",
            tc.chunk_gdn_state_kernel,
            types={
                "k": ACT,
                "w_buf": f32,
                "u_buf": f32,
                "c_buf": f32,
                "rk_buf": f32,
                "h_buf": f32,
                "ssm_state": f32,
                "cu_seqlens": "*i32",
                "state_indices": "*i32",
                "has_initial_state": "*i1",
            },
            constexprs={**common, "BV": cfg["state"]["BV"]},
            num_warps=cfg["state"]["num_warps"],
            num_stages=cfg["state"]["num_stages"],
            representative=representative,
        ),
        case(
            f"gdn.chunk_output[{shape}]",
            tc.chunk_gdn_output_kernel,
            types={
                "q": ACT,
                "k": ACT,
                "o": ACT,
                "vnew_buf": f32,
                "c_buf": f32,
                "h_buf": f32,
                "cu_seqlens": "*i32",
                "state_indices": "*i32",
                "scale": "fp32",
            },
            constexprs={
                **common,
                "BV": cfg["output"]["BV"],
                "BN": 64,
                "USE_QK_L2NORM": True,
                "LOWP_QK": True,
            },
            num_warps=cfg["output"]["num_warps"],
            num_stages=cfg["output"]["num_stages"],
            representative=representative,
        ),
    ]


def compile_cases():
    cases = [
        _recurrent(hv, 128, spec, representative=hv == 32 and spec)
        for hv in (32, 64)
        for spec in (False, True)
    ]
    for hv, d in ((32, 128), (64, 128), (32, 256)):
        cases += _chunk(hv, d, representative=hv == 32)  # both head sizes in the default tier
    return cases
