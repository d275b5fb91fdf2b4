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


def _chunk(hv: int, d: int, representative: bool, *, chunk_size: int = 64, act: str = ACT, hk: int = HK):
    """The five chunked-prefill phases at one shape, as ``triton_chunk`` launches them."""
    from kernels.gated_delta_rule import triton_chunk_cumsum as p1
    from kernels.gated_delta_rule import triton_chunk_output as p5
    from kernels.gated_delta_rule import triton_chunk_solve as p2
    from kernels.gated_delta_rule import triton_chunk_state as p4
    from kernels.gated_delta_rule import triton_chunk_wy as p3

    f32, i32 = "*fp32", "*i32"
    shape = f"Hv={hv},D={d}" + ("" if chunk_size == 64 else f",BT={chunk_size}")
    shape += "" if act == ACT else ",fp32"
    lowp = act != f32
    heads = {"HK": hk, "HV": hv}
    c1, c2, c3 = p1.launch_config(hv), p2.launch_config(d, chunk_size), p3.launch_config(d, d)
    c4, c5 = p4.launch_config(d, d, chunk_size), p5.launch_config(d, d)
    # BN: the rows a launch compares its slot with (a power of two >= N); 64 rows here.
    return [
        case(f"gdn.chunk_cumsum[{shape}]", p1.chunk_gdn_cumsum_kernel,
             types={"g": f32, "gc": f32, "cu_seqlens": i32},
             constexprs={"HV": hv, "BT": chunk_size, "BH": c1["BH"], "BN": 64},
             num_warps=c1["num_warps"], representative=representative),
        case(f"gdn.chunk_solve[{shape}]", p2.chunk_gdn_solve_kernel,
             types={"k": act, "beta": f32, "gc": f32, "a_inv": f32, "rk": f32, "cu_seqlens": i32},
             constexprs={**heads, "DK": d, "BT": chunk_size, "NK": c2["NK"], "BN": 64, "USE_QK_L2NORM": True,
                         "LOWP_QK": lowp, "DOT_PRECISION": "tf32x3"},
             num_warps=c2["num_warps"], num_stages=c2["num_stages"], representative=representative),
        case(f"gdn.chunk_wy[{shape}]", p3.chunk_gdn_wy_kernel,
             types={"k": act, "v": act, "beta": f32, "gc": f32, "a_inv": f32, "rk": f32, "w": f32, "u": f32,
                    "cu_seqlens": i32},
             constexprs={**heads, "DK": d, "DV": d, "BT": chunk_size, "NK": c3["NK"], "BV": c3["BV"],
                         "BN": 64, "DOT_PRECISION": "tf32x3"},
             num_warps=c3["num_warps"], num_stages=c3["num_stages"], representative=representative),
        case(f"gdn.chunk_state[{shape}]", p4.chunk_gdn_state_kernel,
             types={"k": act, "w": f32, "u": f32, "gc": f32, "rk": f32, "h": f32, "ssm_state": f32,
                    "cu_seqlens": i32, "state_indices": i32, "has_initial_state": "*i1"},
             constexprs={**heads, "DK": d, "DV": d, "BT": chunk_size, "BTK": c4["BTK"], "NK": c4["NK"],
                         "BV": c4["BV"], "PAD": PAD_SLOT_ID, "DOT_PRECISION": "tf32x3"},
             num_warps=c4["num_warps"], num_stages=c4["num_stages"], representative=representative),
        case(f"gdn.chunk_output[{shape}]", p5.chunk_gdn_output_kernel,
             types={"q": act, "k": act, "vnew": f32, "gc": f32, "h": f32, "o": act, "cu_seqlens": i32,
                    "state_indices": i32, "scale": "fp32"},
             constexprs={**heads, "DK": d, "DV": d, "BT": chunk_size, "NK": c5["NK"], "BV": c5["BV"],
                         "BN": 64, "PAD": PAD_SLOT_ID, "USE_QK_L2NORM": True, "LOWP_QK": lowp,
                         "DOT_PRECISION": "tf32x3"},
             num_warps=c5["num_warps"], num_stages=c5["num_stages"], representative=representative),
    ]


def compile_cases():
    cases = [
        _recurrent(hv, 128, spec, representative=hv == 32 and spec)
        for hv in (32, 64)
        for spec in (False, True)
    ]
    for hv, d in ((32, 128), (64, 128), (32, 256)):
        cases += _chunk(hv, d, representative=hv == 32)  # both head sizes in the default tier
    # The kernel tests' small shapes with float32 activations, as the GPU runs them: Dk = 16 at chunk 64
    # (where the earlier kernels' float32 products reduced over 16 elements and an H100 hit an illegal
    # memory access) and chunk 16 (the state update's 32-token tile).
    for chunk_size in (64, 16):
        cases += _chunk(4, 16, representative=True, chunk_size=chunk_size, act="*fp32", hk=2)
    return cases
