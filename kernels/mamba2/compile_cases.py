"""Real-shape compile cases for the Mamba2 kernels (see kernels/compile_check.py).

Nemotron-3 Nano (H = 64) and Super (H = 128) Mamba2 layers: head dim P = 64, state N = 128, G = 8
groups, chunk 128, bf16 activations, float32 state pool and dt, verify rows of 1 + K tokens (the
token count is a runtime value, so one compiled kernel serves every K).
"""

from __future__ import annotations

from kernels.compile_check import case
from kernels.constants import PAD_SLOT_ID

P, N, G, CHUNK = 64, 128, 8, 128
MODELS = (("nano", 64), ("super", 128))
ACT = "*bf16"
F32 = "*fp32"


def _state_update(name: str, h: int, spec: bool, representative: bool):
    from kernels.mamba2 import triton_state_update as tsu

    cfg = tsu.launch_config(P, N)
    return case(
        f"mamba2.state_update[{name},H={h},{'verify' if spec else 'decode'}]",
        tsu.selective_state_update_kernel,
        types={
            "x": ACT, "dt": F32, "A": F32, "B": ACT, "C": ACT, "D": F32, "y": ACT, "ssm_state": F32,
            "cu_seqlens": "*i32", "state_indices": "*i32", "has_initial_state": "*i1",
            **({"num_valid": "*i32"} if spec else {}),
        },
        constexprs={
            "H": h, "G": G, "P": P, "N": N, "BP": cfg["BP"], "BN": cfg["BN"], "PAD": PAD_SLOT_ID,
            "IS_SPEC": spec, "HAS_INIT_FLAGS": True, **({} if spec else {"num_valid": None}),
        },
        num_warps=cfg["num_warps"],
        representative=representative,
    )


def _chunk_scan(name: str, h: int, act: str, representative: bool):
    from kernels.mamba2 import triton_chunk_scan as tcs

    cfg = tcs.launch_config(P, N, CHUNK, lowp=act != F32)
    common = {"H": h, "G": G, "P": P, "N": N, "BT": CHUNK, "PAD": PAD_SLOT_ID,
              "DOT_PRECISION": cfg["DOT_PRECISION"]}
    shape = f"{name},H={h},{act.removeprefix('*')}"
    st, out = cfg["state"], cfg["output"]
    return [
        case(
            f"mamba2.chunk_state[{shape}]",
            tcs.ssd_state_kernel,
            types={
                "x": act, "dt": F32, "A": F32, "B": act, "h_buf": F32, "ssm_state": F32,
                "cu_seqlens": "*i32", "state_indices": "*i32", "has_initial_state": "*i1",
                "start_positions": "*i32", "block_state_indices": "*i32",
            },
            constexprs={**common, "BP": st["BP"], "BN": st["BN"], "HAS_INIT_FLAGS": True, "HAS_START": True,
                        "HAS_BLOCKS": True},
            num_warps=st["num_warps"],
            num_stages=st["num_stages"],
            representative=representative,
        ),
        case(
            f"mamba2.chunk_output[{shape}]",
            tcs.ssd_output_kernel,
            types={
                "x": act, "dt": F32, "A": F32, "B": act, "C": act, "D": F32, "y": act, "h_buf": F32,
                "cu_seqlens": "*i32", "state_indices": "*i32", "start_positions": "*i32",
            },
            constexprs={**common, "BI": out["BI"], "BP": out["BP"], "BN": out["BN"], "BR": 64,
                        "LOWP_CB": cfg["LOWP_CB"], "HAS_START": True},
            num_warps=out["num_warps"],
            num_stages=out["num_stages"],
            representative=representative,
        ),
    ]


def compile_cases():
    cases = [
        _state_update(name, h, spec, representative=name == "nano" and spec)
        for name, h in MODELS
        for spec in (False, True)
    ]
    for name, h in MODELS:
        cases += _chunk_scan(name, h, ACT, representative=name == "nano")
    cases += _chunk_scan("nano", 64, F32, representative=False)  # the float32 conformance path
    return cases
