"""What every Triton launch of this package assumes about its arguments, checked at the launch.

A ``LaunchSpec`` per kernel (keyed by the kernel function's name) lists its pointer arguments, each
with the dtypes the kernel is compiled for and the strides its address arithmetic assumes, and the
grid the kernel expects from its other arguments. ``LaunchRecorder`` replaces the launch of every
``@triton.jit`` kernel (compiled or interpreted) by a check against that spec and a record of the
grid and arguments, so a wrapper runs up to its launch without running a kernel: on fake CUDA
tensors (``torch._subclasses.fake_tensor.FakeTensorMode``) that is a CPU-only check of what a GPU
launch would refuse or misread.

Checked at every launch (a violation raises :class:`LaunchError` from the wrapper's launch site):

- every tensor argument is a declared pointer argument, on a CUDA device, all on one device (a CPU
  tensor here is "Pointer argument cannot be accessed from Triton (cpu tensor?)" on a GPU);
- a pointer's dtype is one the kernel takes (or that of the pointer it must match);
- a pointer's strides are those the kernel addresses it with: the stride arguments passed for it,
  unit strides where the kernel steps one element at a time, the whole tensor contiguous where the
  kernel computes offsets from sizes (dimensions of size <= 1 and empty tensors take any stride);
- the grid is a tuple of 1 to 3 plain ints inside CUDA's limits, equal to the spec's grid;
- every other condition the spec ``requires`` of the arguments holds (a block constexpr that must cover
  a whole dimension, a scratch buffer sized for every program that writes it).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from kernels._contract import FLOATS

I32, I64, BOOL = (torch.int32,), (torch.int64,), (torch.bool,)
INDEX = (torch.int32, torch.int64)
GRID_LIMITS = (2**31 - 1, 65535, 65535)  # CUDA's grid size per axis (x, y, z)

# A stride entry: an int (that stride exactly), the name of the argument holding it, a function of the
# bound arguments, or None (any stride).
Stride = int | str | Callable[[SimpleNamespace], int] | None


class LaunchError(AssertionError):
    """A launch whose arguments or grid differ from what the kernel assumes."""


@dataclass(frozen=True)
class Ptr:
    """A pointer argument: ``dtypes`` (or ``"=name"``: the dtype of pointer ``name``) and the strides the
    kernel assumes, ``"contiguous"`` or one tuple of entries per accepted rank."""

    dtypes: tuple[torch.dtype, ...] | str
    strides: str | tuple[tuple[Stride, ...], ...]
    optional: bool = False  # None is accepted (a flag turns the kernel's use of it off)


def rows(*entries: Stride) -> tuple[tuple[Stride, ...], ...]:
    """The strides of a pointer of one rank, one entry per dimension."""
    return (entries,)


CONTIGUOUS = "contiguous"


@dataclass(frozen=True)
class LaunchSpec:
    ptrs: dict[str, Ptr]  # every tensor argument the kernel takes, by parameter name
    grid: Callable[[SimpleNamespace], tuple[int, ...]]  # the expected grid, from the bound arguments
    # (what must hold, a predicate of the bound arguments): the kernel's other assumptions
    requires: tuple[tuple[str, Callable[[SimpleNamespace], bool]], ...] = ()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _shape(name: str, dim: int) -> Callable[[SimpleNamespace], int]:
    return lambda a: getattr(a, name).shape[dim]


def _gdn(name: str) -> dict[str, Ptr]:
    """A GDN token-major input ``[T, H, D]``: token and head strides passed, unit stride over D."""
    return {name: Ptr(FLOATS, rows(f"stride_{name}_t", f"stride_{name}_h", 1))}


_F32 = (torch.float32,)
_IDX_ROWS = (("stride_idx_n",), ("stride_idx_n", 1))  # state indices [N] or [N, K+1] (columns contiguous)

def _rows(a: SimpleNamespace) -> int:
    """The rows of a varlen launch: one per ``cu_seqlens`` interval."""
    return a.cu_seqlens.shape[0] - 1


def _mamba(*names: str) -> dict[str, Ptr]:
    """Mamba2 inputs, token-major with the strides passed and a unit stride on the last dimension:
    ``x [T, H, P]``, ``dt [T, H]``, ``B`` / ``C [T, G, N]``; ``A`` / ``D [H]`` read at ``+ head``."""
    table = {"x": Ptr(FLOATS, rows("stride_x_t", "stride_x_h", 1)), "dt": Ptr(FLOATS, rows("stride_dt_t", 1)),
             "A": Ptr(FLOATS, CONTIGUOUS), "B": Ptr(FLOATS, rows("stride_b_t", "stride_b_g", 1)),
             "C": Ptr(FLOATS, rows("stride_c_t", "stride_c_g", 1)), "D": Ptr(FLOATS, CONTIGUOUS),
             "cu_seqlens": Ptr(I32, CONTIGUOUS)}
    return {name: table[name] for name in names}


def _ssd_slots(a: SimpleNamespace) -> int:
    """Chunk slots of the SSD scan: ``T // BT + 2 N`` (kernels/mamba2/triton_chunk_scan.py)."""
    return a.x.shape[0] // a.BT + 2 * _rows(a)


_MAMBA_ROWS = ("a state_indices row per cu_seqlens row", lambda a: a.state_indices.shape[0] == _rows(a))
_MAMBA_POOL = ("ssm_state [S, H, P, N] (addressed as slot * H * P * N)",
               lambda a: tuple(a.ssm_state.shape[1:]) == (a.H, a.P, a.N))
_H_BUF = ("h_buf [T // BT + 2 N, H, P, N], a slot per chunk",
          lambda a: tuple(a.h_buf.shape) == (_ssd_slots(a), a.H, a.P, a.N))

def _gdn_slots(a: SimpleNamespace, tokens: str) -> int:
    """Chunk slots of the chunked GDN phases: ``T // BT + N``
    (kernels/gated_delta_rule/triton_chunk_common.py)."""
    return getattr(a, tokens).shape[0] // a.BT + _rows(a)


_GDN_BN = ("BN >= N (every row's first chunk slot compared)", lambda a: a.BN >= _rows(a))
_GDN_K_TILES = ("NK tiles of 64 cover Dk", lambda a: a.NK * 64 >= a.DK > (a.NK - 1) * 64)
_GDN_H = ("h [T // BT + N, Hv, Dk, Dv], a slot per chunk",
          lambda a: tuple(a.h.shape) == (_gdn_slots(a, "k"), a.HV, a.DK, a.DV))

SPECS: dict[str, LaunchSpec] = {
    "paged_attention_kernel": LaunchSpec(
        {"q": Ptr(FLOATS, rows("stride_qt", "stride_qh", 1)),
         "k_cache": Ptr(FLOATS, rows("stride_cb", "stride_cs", "stride_ch", 1)),
         "v_cache": Ptr(FLOATS, rows("stride_cb", "stride_cs", "stride_ch", 1)),
         "o": Ptr("=q", rows("stride_ot", "stride_oh", 1)),
         "query_start_loc": Ptr(I32, CONTIGUOUS), "seq_lens": Ptr(I32, CONTIGUOUS),
         "block_table": Ptr(I32, rows("stride_bt", 1))},
        lambda a: (a.q.shape[0] // a.BLOCK_Q + a.N, a.k_cache.shape[2])),
    "causal_conv1d_fwd_kernel": LaunchSpec(
        {"x": Ptr(FLOATS, rows("stride_x_t", 1)), "weight": Ptr(FLOATS, rows("stride_w_c", 1)),
         "bias": Ptr(FLOATS, CONTIGUOUS, optional=True),
         "out": Ptr("=x", rows("stride_o_t", 1)),
         "conv_state": Ptr(FLOATS, rows("stride_s_n", "stride_s_c", 1)), "cu_seqlens": Ptr(I32, CONTIGUOUS),
         "state_indices": Ptr(I32, (("stride_idx_n",), ("stride_idx_n", None))),  # column 0 only
         "has_initial_state": Ptr(BOOL, CONTIGUOUS, optional=True),
         "num_valid": Ptr(I32, CONTIGUOUS, optional=True)},
        lambda a: (a.cu_seqlens.shape[0] - 1, _cdiv(a.C, a.BC))),
    "fused_recurrent_gated_delta_rule_fwd_kernel": LaunchSpec(
        {**_gdn("q"), **_gdn("k"), **_gdn("v"),
         "g": Ptr(FLOATS, rows("stride_g_t", 1)), "beta": Ptr(FLOATS, rows("stride_b_t", 1)),
         "o": Ptr("=v", CONTIGUOUS), "ssm_state": Ptr(FLOATS, CONTIGUOUS), "cu_seqlens": Ptr(I32, CONTIGUOUS),
         "state_indices": Ptr(I32, _IDX_ROWS), "num_valid": Ptr(I32, CONTIGUOUS, optional=True),
         "has_initial_state": Ptr(BOOL, CONTIGUOUS, optional=True)},
        lambda a: (_rows(a) * a.HV, _cdiv(a.DV, a.BV))),
    "chunk_gdn_cumsum_kernel": LaunchSpec(
        {"g": Ptr(FLOATS, rows("stride_g_t", 1)), "gc": Ptr(_F32, CONTIGUOUS),
         "cu_seqlens": Ptr(I32, CONTIGUOUS)},
        lambda a: (_gdn_slots(a, "g"), _cdiv(a.HV, a.BH)),
        requires=(_GDN_BN, ("gc [T, Hv] like g", lambda a: tuple(a.gc.shape) == tuple(a.g.shape) == (
            a.g.shape[0], a.HV)))),
    "chunk_gdn_solve_kernel": LaunchSpec(
        {**_gdn("k"), "beta": Ptr(FLOATS, rows("stride_b_t", 1)), "gc": Ptr(_F32, CONTIGUOUS),
         "a_inv": Ptr(_F32, CONTIGUOUS), "rk": Ptr(_F32, CONTIGUOUS), "cu_seqlens": Ptr(I32, CONTIGUOUS)},
        lambda a: (_gdn_slots(a, "k"), a.HV),
        requires=(_GDN_BN, _GDN_K_TILES, ("a_inv [T, Hv, BT], rk [T, Hv]", lambda a: tuple(a.a_inv.shape) == (
            a.k.shape[0], a.HV, a.BT) and tuple(a.rk.shape) == (a.k.shape[0], a.HV)))),
    "chunk_gdn_wy_kernel": LaunchSpec(
        {**_gdn("k"), **_gdn("v"), "beta": Ptr(FLOATS, rows("stride_b_t", 1)), "gc": Ptr(_F32, CONTIGUOUS),
         "a_inv": Ptr(_F32, CONTIGUOUS), "rk": Ptr(_F32, CONTIGUOUS), "w": Ptr(_F32, CONTIGUOUS),
         "u": Ptr(_F32, CONTIGUOUS), "cu_seqlens": Ptr(I32, CONTIGUOUS)},
        lambda a: (_gdn_slots(a, "k"), a.HV),
        requires=(_GDN_BN, _GDN_K_TILES, ("w [T, Hv, Dk], u [T, Hv, Dv]", lambda a: tuple(a.w.shape) == (
            a.k.shape[0], a.HV, a.DK) and tuple(a.u.shape) == (a.k.shape[0], a.HV, a.DV)))),
    "chunk_gdn_state_kernel": LaunchSpec(
        {**_gdn("k"), "w": Ptr(_F32, CONTIGUOUS), "u": Ptr(_F32, CONTIGUOUS), "gc": Ptr(_F32, CONTIGUOUS),
         "rk": Ptr(_F32, CONTIGUOUS), "h": Ptr(_F32, CONTIGUOUS), "ssm_state": Ptr(FLOATS, CONTIGUOUS),
         "cu_seqlens": Ptr(I32, CONTIGUOUS), "state_indices": Ptr(I32, CONTIGUOUS),
         "has_initial_state": Ptr(BOOL, CONTIGUOUS)},
        lambda a: (_rows(a) * a.HV, _cdiv(a.DV, a.BV)),
        requires=(_GDN_K_TILES, _GDN_H,
                  ("BTK = max(BT, 32): the state update's product reduces over >= 32 float32 (128 bytes)",
                   lambda a: a.BTK == max(a.BT, 32)),
                  ("ssm_state [S, Hv, Dk, Dv] (addressed as slot * Hv * Dk * Dv)",
                   lambda a: tuple(a.ssm_state.shape[1:]) == (a.HV, a.DK, a.DV)))),
    "chunk_gdn_output_kernel": LaunchSpec(
        {**_gdn("q"), **_gdn("k"), "vnew": Ptr(_F32, CONTIGUOUS), "gc": Ptr(_F32, CONTIGUOUS),
         "h": Ptr(_F32, CONTIGUOUS), "o": Ptr(FLOATS, CONTIGUOUS), "cu_seqlens": Ptr(I32, CONTIGUOUS),
         "state_indices": Ptr(I32, CONTIGUOUS)},
        lambda a: (_cdiv(a.DV, a.BV), _gdn_slots(a, "q"), a.HV),
        requires=(_GDN_BN, _GDN_K_TILES, _GDN_H)),
    "prepare_inputs_kernel": LaunchSpec(
        {"idx_mapping": Ptr(I32, CONTIGUOUS), "query_start_loc": Ptr(I32, CONTIGUOUS),
         "is_decode": Ptr(BOOL, CONTIGUOUS), "num_computed": Ptr(I32, CONTIGUOUS),
         "last_sampled": Ptr(I64, CONTIGUOUS), "draft_tokens": Ptr(I64, rows("stride_d", 1)),
         "token_ids": Ptr(I64, rows("stride_tok", 1)), "block_table": Ptr(I32, rows("stride_bt", 1)),
         "input_ids": Ptr(I64, CONTIGUOUS), "positions": Ptr(I64, CONTIGUOUS),
         "seq_lens": Ptr(I32, CONTIGUOUS), "slot_mapping": Ptr(I64, CONTIGUOUS)},
        lambda a: (a.N + 1,)),
    "post_update_kernel": LaunchSpec(
        {"idx_mapping": Ptr(I32, CONTIGUOUS), "query_lens": Ptr(I32, CONTIGUOUS),
         "num_draft_tokens": Ptr(I32, CONTIGUOUS), "is_sampling": Ptr(BOOL, CONTIGUOUS),
         "sampled": Ptr(I64, rows("stride_s", 1)), "num_valid": Ptr(I32, CONTIGUOUS),
         "num_computed": Ptr(INDEX, CONTIGUOUS), "num_valid_state": Ptr(INDEX, CONTIGUOUS),
         "last_sampled": Ptr(INDEX, CONTIGUOUS), "token_ids": Ptr(INDEX, rows("stride_tok", 1)),
         "num_tokens": Ptr(INDEX, CONTIGUOUS)},
        lambda a: (a.idx_mapping.shape[0],)),
    "reshape_and_cache_kernel": LaunchSpec(
        {"k": Ptr(FLOATS, rows("stride_kt", _shape("k", 2), 1)),
         "v": Ptr(FLOATS, rows("stride_vt", _shape("v", 2), 1)),
         "k_cache": Ptr(FLOATS, rows("stride_cb", "stride_cs", _shape("k_cache", 3), 1)),
         "v_cache": Ptr("=k_cache", rows("stride_cb", "stride_cs", _shape("v_cache", 3), 1)),
         "slot_mapping": Ptr(I64, CONTIGUOUS)},
        lambda a: (a.slot_mapping.shape[0],)),
    "linear_kernel": LaunchSpec(
        {"x": Ptr(FLOATS, rows("stride_xm", 1)), "w": Ptr("=x", rows("stride_wn", 1)),
         "y": Ptr("=x", rows("stride_ym", 1))},
        lambda a: (_cdiv(a.M, a.BM), _cdiv(a.N, a.BN))),
    "moe_gate_up_kernel": LaunchSpec(
        {"x": Ptr(FLOATS, rows("stride_xt", 1)), "w13": Ptr("=x", rows("stride_we", "stride_wn", 1)),
         "act": Ptr("=x", rows("stride_ap", 1)), "sorted_pairs": Ptr(I32, CONTIGUOUS),
         "block_expert": Ptr(I32, CONTIGUOUS), "block_start": Ptr(I32, CONTIGUOUS),
         "block_end": Ptr(I32, CONTIGUOUS)},
        lambda a: (a.block_expert.shape[0], _cdiv(a.I, a.BN)),
        requires=(("w13 [E, 2I, H] (gate | up rows), [E, I, H] (up rows) with RELU2",
                   lambda a: a.w13.shape[1] == (1 if a.RELU2 else 2) * a.I),)),
    "moe_down_kernel": LaunchSpec(
        {"act": Ptr(FLOATS, rows("stride_ap", 1)), "w2": Ptr("=act", rows("stride_we", "stride_wn", 1)),
         "y": Ptr("=act", rows("stride_yp", 1)), "sorted_pairs": Ptr(I32, CONTIGUOUS),
         "block_expert": Ptr(I32, CONTIGUOUS), "block_start": Ptr(I32, CONTIGUOUS),
         "block_end": Ptr(I32, CONTIGUOUS)},
        lambda a: (a.block_expert.shape[0], _cdiv(a.H, a.BN))),
    "moe_combine_kernel": LaunchSpec(
        {"y": Ptr(FLOATS, rows("stride_yp", 1)), "topk_weights": Ptr(FLOATS, rows("stride_wt", 1)),
         "out": Ptr("=y", rows("stride_ot", 1))},
        lambda a: (a.out.shape[0], _cdiv(a.H, a.BH))),
    "rms_norm_kernel": LaunchSpec(
        {"x": Ptr(FLOATS, rows("stride_x", 1)), "w": Ptr(FLOATS, CONTIGUOUS),
         "y": Ptr("=x", rows("stride_y", 1))},
        lambda a: (a.x.shape[0],)),
    "gated_rms_norm_kernel": LaunchSpec(
        {"x": Ptr(FLOATS, CONTIGUOUS), "z": Ptr(FLOATS, CONTIGUOUS), "w": Ptr(FLOATS, CONTIGUOUS),
         "y": Ptr("=x", CONTIGUOUS)},
        lambda a: (a.x.numel() // a.D,)),
    "greedy_verify_kernel": LaunchSpec(
        {"target_logits": Ptr(FLOATS, rows("stride_l", 1)), "draft_tokens": Ptr(I64, rows("stride_d", 1)),
         "num_draft_tokens": Ptr(I32, CONTIGUOUS), "cu_num_logits": Ptr(I32, CONTIGUOUS),
         "output_tokens": Ptr(I64, rows("stride_o", 1)), "num_valid": Ptr(I32, CONTIGUOUS)},
        lambda a: (a.num_valid.shape[0],)),
    "selective_state_update_kernel": LaunchSpec(
        {**_mamba("x", "dt", "A", "B", "C", "D", "cu_seqlens"), "y": Ptr("=x", CONTIGUOUS),
         "ssm_state": Ptr(FLOATS, CONTIGUOUS), "state_indices": Ptr(I32, _IDX_ROWS),
         "num_valid": Ptr(I32, CONTIGUOUS, optional=True),
         "has_initial_state": Ptr(BOOL, CONTIGUOUS, optional=True)},
        lambda a: (_rows(a) * a.H, _cdiv(a.P, a.BP)),
        requires=(("BN >= N (the whole state row in one block)", lambda a: a.BN >= a.N),
                  ("num_cols = the columns of state_indices",
                   lambda a: a.num_cols == (a.state_indices.shape[1] if a.state_indices.dim() == 2 else 1)),
                  _MAMBA_ROWS, _MAMBA_POOL)),
    "ssd_state_kernel": LaunchSpec(
        {**_mamba("x", "dt", "A", "B", "cu_seqlens"), "h_buf": Ptr(_F32, CONTIGUOUS),
         "ssm_state": Ptr(FLOATS, CONTIGUOUS), "state_indices": Ptr(I32, CONTIGUOUS),
         "has_initial_state": Ptr(BOOL, CONTIGUOUS, optional=True),
         "start_positions": Ptr(I32, CONTIGUOUS, optional=True),
         "block_state_indices": Ptr(I32, rows("stride_blk_n", 1), optional=True)},
        lambda a: (_rows(a) * a.H, _cdiv(a.P, a.BP), _cdiv(a.N, a.BN)),
        requires=(_MAMBA_ROWS, _MAMBA_POOL, _H_BUF,
                  ("num_block_cols = the columns of block_state_indices",
                   lambda a: a.num_block_cols == (0 if a.block_state_indices is None
                                                  else a.block_state_indices.shape[1])))),
    "ssd_output_kernel": LaunchSpec(
        {**_mamba("x", "dt", "A", "B", "C", "D", "cu_seqlens"), "y": Ptr("=x", CONTIGUOUS),
         "h_buf": Ptr(_F32, CONTIGUOUS), "state_indices": Ptr(I32, CONTIGUOUS),
         "start_positions": Ptr(I32, CONTIGUOUS, optional=True)},
        lambda a: (_cdiv(a.P, a.BP) * (a.BT // a.BI), _ssd_slots(a), a.H),
        requires=(("BN >= N (the whole state row in one block)", lambda a: a.BN >= a.N),
                  ("BI divides BT (query blocks tile the chunk)", lambda a: a.BT % a.BI == 0),
                  ("N_ROWS = the cu_seqlens rows and BR >= N_ROWS (every row's first slot compared)",
                   lambda a: a.N_ROWS == _rows(a) and a.BR >= a.N_ROWS),
                  _MAMBA_ROWS, _H_BUF)),
    "gated_group_rms_norm_kernel": LaunchSpec(
        {"x": Ptr(FLOATS, rows("stride_x", 1)), "z": Ptr(FLOATS, rows("stride_z", 1)),
         "w": Ptr(FLOATS, CONTIGUOUS), "y": Ptr("=x", rows("stride_y", 1))},
        lambda a: (a.x.shape[0] * a.GROUPS,),
        requires=(("GROUPS * GS = the row width, BG >= GS",
                   lambda a: a.GROUPS * a.GS == a.x.shape[1] == a.w.shape[0] and a.BG >= a.GS),)),
    "relu2_kernel": LaunchSpec(
        {"x": Ptr(FLOATS, rows("stride_x", 1)), "y": Ptr("=x", rows("stride_y", 1))},
        lambda a: (a.x.shape[0], _cdiv(a.H, a.BH)),
        requires=(("H = the row width of x and y", lambda a: a.H == a.x.shape[1] == a.y.shape[1]),)),
    "silu_mul_kernel": LaunchSpec(
        {"gate": Ptr(FLOATS, rows("stride_gate", 1)), "up": Ptr("=gate", rows("stride_up", 1)),
         "y": Ptr("=gate", rows("stride_y", 1))},
        lambda a: (a.gate.shape[0], _cdiv(a.I, a.BI)),
        requires=(("I = the row width of gate, up and y",
                   lambda a: a.I == a.gate.shape[1] == a.up.shape[1] == a.y.shape[1]),)),
    "rotary_kernel": LaunchSpec(
        {"x": Ptr(FLOATS, rows("stride_x_t", "stride_x_h", 1)),
         "y": Ptr("=x", rows("stride_y_t", "stride_y_h", 1)), "positions": Ptr(INDEX, CONTIGUOUS)},
        lambda a: (a.x.shape[0], _cdiv(a.H, a.BH)),
        requires=(("H, D = x's and y's heads and width, 2 * HALF <= D, BHALF >= HALF, T = the positions",
                   lambda a: a.H == a.x.shape[1] == a.y.shape[1] and a.D == a.x.shape[2] == a.y.shape[2]
                   and 2 * a.HALF <= a.D and a.BHALF >= a.HALF and a.positions.shape[0] == a.x.shape[0]),)),
    "gdn_gating_kernel": LaunchSpec(
        {"a_log": Ptr(FLOATS, CONTIGUOUS), "a": Ptr(FLOATS, rows("stride_a", 1)),
         "dt_bias": Ptr(FLOATS, CONTIGUOUS), "b": Ptr(FLOATS, rows("stride_b", 1)),
         "g": Ptr(_F32, CONTIGUOUS), "beta": Ptr(_F32, CONTIGUOUS)},
        lambda a: (_cdiv(a.T, a.BT),),
        requires=(("HV = the heads of a, b, g, A_log and dt_bias, BHV >= HV, T = the rows of a",
                   lambda a: a.HV == a.a.shape[1] == a.b.shape[1] == a.g.shape[1] == a.a_log.shape[0]
                   == a.dt_bias.shape[0] and a.BHV >= a.HV and a.T == a.a.shape[0] == a.g.shape[0]),)),
}


@dataclass
class Launch:
    """One recorded launch: the kernel's name, its grid and its bound arguments (constexprs included)."""

    kernel: str
    grid: tuple
    args: dict


def _stride_ok(t: torch.Tensor, expected: tuple[Stride, ...], a: SimpleNamespace) -> bool:
    if t.dim() != len(expected):
        return False
    if t.numel() == 0:
        return True
    for size, stride, want in zip(t.shape, t.stride(), expected):
        if want is None or size <= 1:
            continue
        value = getattr(a, want) if isinstance(want, str) else want(a) if callable(want) else want
        if stride != value:
            return False
    return True


def check_launch(kernel: str, grid, args: dict) -> None:
    """Raise :class:`LaunchError` naming the kernel and the argument when the launch is not what
    ``SPECS[kernel]`` says the kernel assumes."""
    spec = SPECS.get(kernel)
    if spec is None:
        raise LaunchError(f"{kernel}: no launch spec (add one to kernels/_launch_check.py)")
    a = SimpleNamespace(**args)

    def fail(what: str) -> None:
        raise LaunchError(f"{kernel}: {what}")

    device = None
    for name, value in args.items():
        if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
            fail(f"argument {name} holds tensors in a {type(value).__name__}")
        if not isinstance(value, torch.Tensor):
            continue
        if name not in spec.ptrs:
            fail(f"tensor argument {name} ({value.dtype} on {value.device}) is not a pointer the kernel "
                 "takes (a scalar argument must be a Python number, read without a host sync)")
        if value.device.type != "cuda":
            fail(f"pointer argument {name} is on {value.device}, not on the GPU: Triton cannot access it "
                 "(a tensor built without device=?)")
        if device is None:
            device = value.device
        elif value.device != device:
            fail(f"pointer argument {name} is on {value.device}, the others on {device}")
    for name, ptr in spec.ptrs.items():
        t = args.get(name)
        if t is None:
            if not ptr.optional:
                fail(f"pointer argument {name} is missing")
            continue
        if not isinstance(t, torch.Tensor):
            fail(f"pointer argument {name} is a {type(t).__name__}, not a tensor")
        dtypes = (args[ptr.dtypes[1:]].dtype,) if isinstance(ptr.dtypes, str) else ptr.dtypes
        if t.dtype not in dtypes:
            fail(f"pointer argument {name} is {t.dtype}, the kernel takes {dtypes}")
        if ptr.strides == CONTIGUOUS:
            ok = t.is_contiguous()
        else:
            ok = any(_stride_ok(t, entries, a) for entries in ptr.strides)
        if not ok:
            fail(f"pointer argument {name} {list(t.shape)} has strides {t.stride()}, the kernel assumes "
                 f"{ptr.strides}")
    if callable(grid) or not isinstance(grid, tuple) or not 1 <= len(grid) <= 3:
        fail(f"grid must be a tuple of 1 to 3 ints, got {grid!r}")
    for axis, (size, limit) in enumerate(zip(grid, GRID_LIMITS)):
        if type(size) is not int:
            fail(f"grid axis {axis} is {size!r} ({type(size).__name__}), not a plain int (a tensor or a "
                 "host read of one has no place in a grid)")
        if not 0 <= size <= limit:
            fail(f"grid axis {axis} is {size}, outside CUDA's 0 to {limit} programs on that axis")
    want = tuple(spec.grid(a))
    if tuple(grid) != want:
        fail(f"grid {tuple(grid)} differs from the {want} its arguments call for")
    for what, holds in spec.requires:
        if not holds(a):
            fail(f"the kernel assumes {what}")


def _kernel_classes() -> list[type]:
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - a Triton without its interpreter
        pass
    return classes


@dataclass
class LaunchRecorder:
    """While active (``with recorder.active():``), every Triton launch is checked and recorded in
    ``launches`` instead of run. Not thread-safe by design: the patch is on Triton's classes."""

    launches: list[Launch] = field(default_factory=list)

    @contextmanager
    def active(self) -> Iterator[LaunchRecorder]:
        patched = []
        recorder = self

        def run(fn_self, *args, grid, warmup, **kwargs):
            fn = getattr(fn_self, "fn", fn_self)
            names = list(inspect.signature(fn).parameters)
            bound = dict(zip(names, args))
            bound.update({k: v for k, v in kwargs.items() if k in names})
            for name in names:
                bound.setdefault(name, None)
            kernel = fn.__name__
            check_launch(kernel, grid, bound)
            recorder.launches.append(Launch(kernel, tuple(grid), bound))

        for cls in _kernel_classes():
            patched.append((cls, cls.__dict__["run"]))
            cls.run = run
        try:
            yield self
        finally:
            for cls, original in patched:
                cls.run = original

    def kernels(self) -> list[str]:
        return [launch.kernel for launch in self.launches]
