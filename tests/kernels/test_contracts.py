"""Both kernel backends accept and refuse the same inputs: one contract table per op.

A row of a table is (what, input maker, expected): ``ACCEPTED`` or a substring of the
``KernelInputError`` every backend must raise, with the same message. Each row runs on the torch
reference and on the Triton kernel (under the interpreter on CPU, compiled on a CUDA device). An
accepted row must give the same outputs and the same in-place updates on both; a refused row must
leave every input as it was. The inputs are tiny: the interpreter runs every accepted row.

The KV-cache block size is the one input the backends differ on by design: the reference serves any
block size, the Triton attention the ones ``kernels.attention.check_block_size`` accepts, which the
engines check when they are built for a CUDA device (tests/kernels/test_attention.py).
"""

from __future__ import annotations

import importlib
import inspect
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import kernels
import kernels.input_prep
from kernels import KernelInputError
from kernels._testing import assert_close
from kernels.constants import PAD_SLOT_ID
from tests.kernels.conftest import generator, requires_triton
from tests.kernels.slot_contract import cu_seqlens_for
from tests.kernels.test_input_prep import build

ACCEPTED = "accepted"
LOWP_RATIO = 2e-2  # 16-bit results: the two backends may round a value to neighbouring 16-bit numbers


@dataclass(frozen=True)
class Row:
    what: str
    make: Callable[[], dict]  # a fresh, seeded set of keyword arguments on every call
    expected: str = ACCEPTED
    slow: bool = False  # an accepted row whose interpreted kernel run belongs to -m slow


def slow(row: Row) -> Row:
    """``row`` run under ``-m slow`` only (an interpreted launch of a costly kernel the default tier
    already covers with another row)."""
    return Row(row.what, row.make, row.expected, slow=True)


@dataclass(frozen=True)
class Op:
    fn: Callable
    rows: tuple[Row, ...]
    ratio: float  # float32 results of the two backends agree to this relative RMS error
    backends: tuple[str, ...] = ("torch", "triton")


def variant(base: Callable[[], dict], edit: Callable[[dict], None] | None = None,
            **changes) -> Callable[[], dict]:
    """A maker: ``base()`` edited as a whole by ``edit``, then ``changes[name]`` applied to argument
    ``name`` (a function of the old value, or the new value)."""

    def make() -> dict:
        inputs = base()
        if edit is not None:
            edit(inputs)
        for name, change in changes.items():
            inputs[name] = change(inputs[name]) if callable(change) else change
        return inputs

    return make


def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values with a stride of 2 on the last dimension (a slice of a wider tensor)."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


def long(x):
    return x.long()


def bf16(x):
    return x.bfloat16()


def on_meta(x):
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


# ------------------------------------------------- the slot contract of the recurrent-state ops

def slot_inputs(lens) -> dict:
    """Offsets of rows with the given lengths (three rows) and their int32 pool slots 2, 0, 1."""
    return {"cu_seqlens": cu_seqlens_for(lens), "state_indices": torch.tensor([2, 0, 1], dtype=torch.int32)}


def speculative(inputs: dict) -> None:
    """2-D state_indices (K = 2) with accepted counts: row 0 reads slot 3 and writes slots 2, 3; row 2
    reads slot 1 and writes slots 1, 0 (its last column is padding). Rows own distinct slots."""
    inputs["state_indices"] = torch.tensor([[2, 3, PAD_SLOT_ID], [PAD_SLOT_ID] * 3, [1, 0, PAD_SLOT_ID]],
                                           dtype=torch.int64)
    inputs["num_valid"] = torch.tensor([2, 1, 1], dtype=torch.int64)
    inputs["has_initial_state"] = None


def slot_rows(base: Callable[[], dict], accepted: Callable[[Row], Row] = lambda row: row) -> tuple[Row, ...]:
    """Rows on the slot arguments both forms of both recurrent-state ops share (kernels/_recurrent_slots.py);
    ``accepted`` wraps the accepted ones (``slow`` where their kernel runs are costly)."""
    return (
        accepted(Row("int64 cu_seqlens and state_indices",
                     variant(base, cu_seqlens=long, state_indices=long))),
        accepted(Row("no has_initial_state", variant(base, has_initial_state=None))),
        Row("float cu_seqlens", variant(base, cu_seqlens=lambda x: x.float()),
            "cu_seqlens must be an int32 or int64 tensor of shape [N+1]"),
        Row("int16 state_indices", variant(base, state_indices=lambda x: x.short()),
            "state_indices must be an int32 or int64 tensor"),
        Row("integer has_initial_state", variant(base, has_initial_state=lambda x: x.int()),
            "has_initial_state must be None or a bool tensor of shape [N] = [3]"),
    )


def speculative_rows(base: Callable[[], dict]) -> tuple[Row, ...]:
    """Rows on the speculative (2-D) state_indices the recurrent forms take."""
    return (
        Row("speculative rows: 2-D int64 state_indices, int64 num_valid",
            variant(base, speculative)),
        Row("no accepted counts with 2-D state_indices", variant(base, speculative, num_valid=None),
            "num_valid must be an int32 or int64 tensor of shape [N] with 2-D state_indices"),
        Row("accepted counts with 1-D state_indices",
            variant(base, num_valid=torch.ones(3, dtype=torch.int32)),
            "num_valid must be None with 1-D state_indices"),
    )


# ------------------------------------------------------------------------------ gated delta rule

def gdn_inputs(seed: int, hk: int = 1, hv: int = 2, dk: int = 16, dv: int = 16, lens=(2, 0, 3)) -> dict:
    """Rows of the given lengths (one empty), a pool of four slots, int32 indices, float32 tensors."""
    g = generator(seed)
    t = sum(lens)
    return {
        "q": torch.randn(t, hk, dk, generator=g), "k": torch.randn(t, hk, dk, generator=g),
        "v": torch.randn(t, hv, dv, generator=g),
        "g": F.logsigmoid(torch.randn(t, hv, generator=g) + 2.0), "beta": torch.rand(t, hv, generator=g),
        "ssm_state": 0.5 * torch.randn(4, hv, dk, dv, generator=g), **slot_inputs(lens),
    }


def recurrent_base() -> dict:
    return {**gdn_inputs(1), "has_initial_state": torch.tensor([True, False, True])}


def gqa(inputs: dict) -> None:
    """Two key heads and four value heads."""
    fresh = gdn_inputs(2, hk=2, hv=4)
    inputs.update({name: fresh[name] for name in ("q", "k", "v", "g", "beta", "ssm_state")})


def huge_prefill(inputs: dict) -> None:
    """Over a million tokens (stride-0 views: the contract reads shapes only)."""
    t = 1 << 20
    for name in ("q", "k", "v", "g", "beta"):
        x = inputs[name]
        inputs[name] = x[:1].expand(t, *x.shape[1:])
    inputs["cu_seqlens"] = torch.tensor([0, 1, 1, t], dtype=torch.int32)


def gdn_common_rows(base: Callable[[], dict]) -> tuple[Row, ...]:
    """Rows both gated delta rule ops share."""
    return (
        Row("the engines' form: int32 indices, float32, contiguous", base),
        *slot_rows(base),
        Row("bfloat16 g and beta", variant(base, g=bf16, beta=bf16)),
        Row("bfloat16 ssm_state pool", variant(base, ssm_state=bf16)),
        Row("bfloat16 q, k, v", variant(base, q=bf16, k=bf16, v=bf16)),
        Row("float32 q with bfloat16 k", variant(base, k=bf16)),
        Row("q, k, v with a stride over the head dim", variant(base, q=strided, k=strided, v=strided)),
        Row("g and beta with a stride over heads", variant(base, g=strided, beta=strided)),
        Row("ssm_state with a stride over Dv (a view of a wider pool)", variant(base, ssm_state=strided)),
        Row("has_initial_state with a stride", variant(base, has_initial_state=lambda x: x.repeat(2)[::2])),
        Row("grouped value heads (Hv a multiple of Hk)", variant(base, gqa)),
        Row("float64 q", variant(base, q=lambda x: x.double()),
            "q must be a float32, bfloat16 or float16 tensor of shape [T, Hk, Dk], got float64"),
        Row("k with another head dim", variant(base, k=lambda x: x[..., :12]),
            "k must be a float32, bfloat16 or float16 tensor of shape [T, Hk, Dk] = [5, 1, 16]"),
        Row("Hv not a multiple of Hk", variant(base, gqa, v=lambda x: x[:, :3]),
            "v must be a tensor whose Hv is a multiple of Hk = 2, got Hv = 3"),
        Row("g of shape [T]", variant(base, g=lambda x: x[:, 0]), "g must be"),
        Row("integer beta", variant(base, beta=lambda x: x.int()), "beta must be a float32"),
        Row("ssm_state with another Dk", variant(base, ssm_state=lambda x: x[:, :, :8]),
            "ssm_state must be a float32, bfloat16 or float16 tensor of shape [S, Hv, Dk, Dv] = "
            "[*, 2, 16, 16]"),
        Row("empty cu_seqlens", variant(base, cu_seqlens=lambda x: x[:0]),
            "cu_seqlens must be a tensor with N+1 >= 1"),
        Row("state_indices for another row count", variant(base, state_indices=lambda x: x[:2]),
            "state_indices must be an int32 or int64 tensor of shape [N] = [3]"),
        Row("a tensor scale", variant(base, scale=torch.tensor(0.25)), "scale must be None or a float"),
        Row("use_qk_l2norm as 1", variant(base, use_qk_l2norm=1),
            "use_qk_l2norm must be True or False, got 1"),
        Row("v on another device", variant(base, v=on_meta), "v must be on the device of the other inputs"),
    )


RECURRENT_ROWS = gdn_common_rows(recurrent_base) + speculative_rows(recurrent_base) + (
    Row("3-D state_indices", variant(recurrent_base, state_indices=lambda x: x[:, None, None]),
        "state_indices must be an int32 or int64 tensor of shape [N] = [3] or [N, K+1] = [3, *]"),
)


def chunk_base() -> dict:
    return {**recurrent_base(), "chunk_size": 16}


CHUNK_ROWS = gdn_common_rows(chunk_base) + (
    Row("chunk_size 32", variant(chunk_base, chunk_size=32)),
    Row("Dk = 256, the most the chunk kernels hold", variant(chunk_base, lambda a: a.update(
        {k: v for k, v in gdn_inputs(3, dk=256, dv=16).items() if k in ("q", "k", "ssm_state")}))),
    Row("Dk = 264", variant(chunk_base, lambda a: a.update(
        {k: v for k, v in gdn_inputs(3, dk=264, dv=16).items() if k in ("q", "k", "ssm_state")})),
        "q must be a tensor with Dk <= 256 (the chunk kernels' limit), got Dk = 264"),
    Row("chunk_size 8", variant(chunk_base, chunk_size=8), "chunk_size must be one of (16, 32, 64), got 8"),
    Row("chunk_size 128", variant(chunk_base, chunk_size=128),
        "chunk_size must be one of (16, 32, 64), got 128"),
    Row("chunk_size 48", variant(chunk_base, chunk_size=48),
        "chunk_size must be one of (16, 32, 64), got 48"),
    Row("chunk_size 16.0", variant(chunk_base, chunk_size=16.0),
        "chunk_size must be one of (16, 32, 64), got 16.0"),
    Row("2-D state_indices", variant(chunk_base, state_indices=lambda x: x[:, None]),
        "state_indices must be an int32 or int64 tensor of shape [N] = [3], got"),
    Row("more chunks than a CUDA grid axis takes", variant(chunk_base, huge_prefill),
        "q must be short enough that T // chunk_size + N <= 65535"),
)


# ------------------------------------------------------------------------------------------ conv1d

def conv_fn_base() -> dict:
    g = generator(4)
    return {
        "x": torch.randn(5, 6, generator=g), "weight": torch.randn(6, 4, generator=g),
        "conv_state": torch.randn(4, 6, 5, generator=g),
        "cu_seqlens": torch.tensor([0, 2, 2, 5], dtype=torch.int32),
        "state_indices": torch.tensor([2, 0, 1], dtype=torch.int32),
        "has_initial_state": torch.tensor([True, False, True]),
    }


def conv_common_rows(base: Callable[[], dict], cu: str) -> tuple[Row, ...]:
    return (
        Row("the engines' form: int32 indices, float32, contiguous", base),
        Row(f"int64 {cu} and state_indices", variant(base, **{cu: long, "state_indices": long})),
        Row("bfloat16 x, weight and conv_state", variant(base, x=bf16, weight=bf16, conv_state=bf16)),
        Row("x with a stride over channels", variant(base, x=strided)),
        Row("weight with a stride over taps", variant(base, weight=strided)),
        Row("conv_state with a stride over columns (a view of a wider pool)",
            variant(base, conv_state=strided)),
        Row("no activation", variant(base, activation=None)),
        Row("activation 'relu'", variant(base, activation="relu"),
            "activation must be one of ('silu', None), got 'relu'"),
        Row("a one-tap weight", variant(base, weight=lambda w: w[:, :1]),
            "weight must be a tensor with W >= 2"),
        Row("a conv_state narrower than the window", variant(base, conv_state=lambda s: s[:, :, :2]),
            "conv_state must be a tensor with L >= 3, got L = 2"),
        Row("weight for other channels", variant(base, weight=lambda w: w[:5]),
            "weight must be a float32, bfloat16 or float16 tensor of shape [C, W] = [6, *]"),
        Row("float64 x", variant(base, x=lambda x: x.double()),
            "x must be a float32, bfloat16 or float16 tensor"),
        Row(f"float {cu}", variant(base, **{cu: lambda t: t.float()}),
            f"{cu} must be an int32 or int64 tensor"),
    )


def with_bias(inputs: dict) -> None:
    inputs["bias"] = torch.randn(6, generator=generator(14))


CONV_FN_ROWS = conv_common_rows(conv_fn_base, "cu_seqlens") + (
    Row("a bias", variant(conv_fn_base, with_bias)),
    Row("a bfloat16 bias with a stride",
        variant(conv_fn_base, with_bias, bias=lambda b: strided(b.bfloat16()))),
    Row("a bias for other channels", variant(conv_fn_base, with_bias, bias=lambda b: b[:5]),
        "causal_conv1d_fn: bias must be a float32, bfloat16 or float16 tensor of shape [C] = [6]"),
    Row("no has_initial_state", variant(conv_fn_base, has_initial_state=None)),
    Row("2-D state_indices", variant(conv_fn_base, state_indices=lambda x: x[:, None]),
        "state_indices must be an int32 or int64 tensor of shape [N] = [3], got"),
    Row("integer has_initial_state", variant(conv_fn_base, has_initial_state=lambda x: x.long()),
        "has_initial_state must be None or a bool tensor"),
)


def conv_update_base() -> dict:
    g = generator(5)
    return {
        "x": torch.randn(4, 6, generator=g), "weight": torch.randn(6, 4, generator=g),
        "conv_state": torch.randn(4, 6, 5, generator=g),
        "query_start_loc": torch.tensor([0, 1, 1, 4], dtype=torch.int32),
        "state_indices": torch.tensor([[2, 3, PAD_SLOT_ID], [0, PAD_SLOT_ID, PAD_SLOT_ID], [1, 0, 3]],
                                      dtype=torch.int32),
        "num_valid": torch.tensor([2, 1, 3], dtype=torch.int32),
    }


CONV_UPDATE_ROWS = conv_common_rows(conv_update_base, "query_start_loc") + (
    Row("a bias", variant(conv_update_base, with_bias)),
    Row("an integer bias", variant(conv_update_base, with_bias, bias=lambda b: b.int()),
        "causal_conv1d_update: bias must be None or a float32"),
    Row("int64 num_valid", variant(conv_update_base, num_valid=long)),
    Row("1-D state_indices", variant(conv_update_base, state_indices=lambda x: x[:, 0])),
    Row("no num_valid", variant(conv_update_base, num_valid=None)),
    Row("float num_valid", variant(conv_update_base, num_valid=lambda x: x.float()),
        "num_valid must be None or an int32 or int64 tensor of shape [N] = [3]"),
    Row("3-D state_indices", variant(conv_update_base, state_indices=lambda x: x[:, :, None]),
        "state_indices must be an int32 or int64 tensor of shape [N] = [3] or [N, K+1] = [3, *]"),
)


# --------------------------------------------------------------------------------------- attention

def attention_base() -> dict:
    """Two rows (2 and 3 query tokens, contexts 4 and 3), one padding token, 4-token blocks."""
    g = generator(6)
    return {
        "q": torch.randn(6, 2, 16, generator=g),
        "k_cache": torch.randn(4, 4, 1, 16, generator=g), "v_cache": torch.randn(4, 4, 1, 16, generator=g),
        "query_start_loc": torch.tensor([0, 2, 5], dtype=torch.int32),
        "seq_lens": torch.tensor([4, 3], dtype=torch.int32),
        "block_table": torch.tensor([[1, 3], [2, 0]], dtype=torch.int32), "scale": 0.25,
    }


ATTENTION_ROWS = (
    Row("the engines' form: int32 row tensors, float32, contiguous", attention_base),
    Row("int64 query_start_loc, seq_lens, block_table",
        variant(attention_base, query_start_loc=long, seq_lens=long, block_table=long)),
    Row("q with a stride over the head dim", variant(attention_base, q=strided)),
    Row("caches with a stride over the head dim", variant(attention_base, k_cache=strided, v_cache=strided)),
    Row("caches with different strides", variant(attention_base, v_cache=strided)),
    Row("block_table with a stride over blocks", variant(attention_base, block_table=strided)),
    Row("bfloat16 q, k_cache, v_cache", variant(attention_base, q=bf16, k_cache=bf16, v_cache=bf16)),
    Row("float32 q over bfloat16 caches", variant(attention_base, k_cache=bf16, v_cache=bf16)),
    Row("bfloat16 k_cache with a float32 v_cache", variant(attention_base, k_cache=bf16)),
    Row("Hq not a multiple of Hkv", variant(attention_base, q=lambda x: torch.cat([x, x[:, :1]], 1),
                                            k_cache=lambda c: c.expand(4, 4, 2, 16),
                                            v_cache=lambda c: c.expand(4, 4, 2, 16)),
        "q must be a tensor whose Hq is a multiple of Hkv = 2, got Hq = 3"),
    Row("v_cache of another head dim", variant(attention_base, v_cache=lambda c: c[..., :8]),
        "v_cache must be a float32, bfloat16 or float16 tensor of shape [num_blocks, block_size, Hkv, D] = "
        "[4, 4, 1, 16]"),
    Row("seq_lens for another row count", variant(attention_base, seq_lens=lambda x: x[:1]),
        "seq_lens must be an int32 or int64 tensor of shape [N] = [2]"),
    Row("a 1-D block_table", variant(attention_base, block_table=lambda x: x[:, 0]),
        "block_table must be an int32 or int64 tensor of shape [N, max_blocks] = [2, *]"),
    Row("no scale", variant(attention_base, scale=None), "scale must be a float, got None"),
    Row("float64 caches", variant(attention_base, k_cache=lambda c: c.double(), v_cache=lambda c: c.double()),
        "k_cache must be a float32, bfloat16 or float16 tensor"),
)


# ---------------------------------------------------------------------------------------- kv cache

def kv_cache_base() -> dict:
    g = generator(7)
    return {
        "k": torch.randn(4, 2, 8, generator=g), "v": torch.randn(4, 2, 8, generator=g),
        "k_cache": torch.randn(3, 4, 2, 8, generator=g), "v_cache": torch.randn(3, 4, 2, 8, generator=g),
        "slot_mapping": torch.tensor([0, 5, PAD_SLOT_ID, 9], dtype=torch.int64),
    }


KV_CACHE_ROWS = (
    Row("the engines' form: int64 slots, float32, contiguous", kv_cache_base),
    Row("int32 slot_mapping", variant(kv_cache_base, slot_mapping=lambda x: x.int())),
    Row("k and v with a stride over the head dim", variant(kv_cache_base, k=strided, v=strided)),
    Row("k with a stride over heads",
        variant(kv_cache_base, k=lambda x: x.transpose(0, 1).contiguous().transpose(0, 1))),
    Row("v_cache with a stride over the head dim (written through a copy)",
        variant(kv_cache_base, v_cache=strided)),
    Row("bfloat16 caches fed float32 k, v", variant(kv_cache_base, k_cache=bf16, v_cache=bf16)),
    Row("float slot_mapping", variant(kv_cache_base, slot_mapping=lambda x: x.float()),
        "slot_mapping must be an int32 or int64 tensor of shape [T] = [4]"),
    Row("slot_mapping for fewer tokens", variant(kv_cache_base, slot_mapping=lambda x: x[:3]),
        "slot_mapping must be an int32 or int64 tensor of shape [T] = [4], got int64 tensor of shape [3]"),
    Row("caches with other heads",
        variant(kv_cache_base, k_cache=lambda c: c[:, :, :1], v_cache=lambda c: c[:, :, :1]),
        "k_cache must be a float32, bfloat16 or float16 tensor of shape [num_blocks, block_size, Hkv, D] = "
        "[*, *, 2, 8]"),
    Row("float64 k", variant(kv_cache_base, k=lambda x: x.double()), "k must be a float32"),
)


# ------------------------------------------------------------------------------------------ verify

def verify_base() -> dict:
    """Three rows with 2, 0 and 1 drafts; row 0's first draft is the target's choice."""
    g = generator(8)
    logits = torch.randn(6, 10, generator=g)
    drafts = torch.randint(0, 10, (3, 2), generator=g)
    drafts[0, 0] = logits[0].argmax()
    return {"target_logits": logits, "draft_tokens": drafts,
            "num_draft_tokens": torch.tensor([2, 0, 1], dtype=torch.int32),
            "cu_num_logits": torch.tensor([0, 3, 4, 6], dtype=torch.int32)}


VERIFY_ROWS = (
    Row("the engines' form: int64 drafts, int32 counts, contiguous", verify_base),
    Row("int32 draft_tokens", variant(verify_base, draft_tokens=lambda x: x.int())),
    Row("int64 num_draft_tokens and cu_num_logits",
        variant(verify_base, num_draft_tokens=long, cu_num_logits=long)),
    Row("target_logits with a stride over the vocabulary", variant(verify_base, target_logits=strided)),
    Row("draft_tokens with a stride", variant(verify_base, draft_tokens=strided)),
    Row("strided num_draft_tokens and cu_num_logits",
        variant(verify_base, num_draft_tokens=strided, cu_num_logits=strided)),
    Row("bfloat16 target_logits", variant(verify_base, target_logits=bf16)),
    Row("float draft_tokens", variant(verify_base, draft_tokens=lambda x: x.float()),
        "draft_tokens must be an int32 or int64 tensor of shape [N, K]"),
    Row("bool num_draft_tokens", variant(verify_base, num_draft_tokens=lambda x: x.bool()),
        "num_draft_tokens must be an int32 or int64 tensor of shape [N] = [3], got bool"),
    Row("cu_num_logits for another row count", variant(verify_base, cu_num_logits=lambda x: x[:3]),
        "cu_num_logits must be an int32 or int64 tensor of shape [N+1] = [4], got int32 tensor of shape [3]"),
    Row("1-D target_logits", variant(verify_base, target_logits=lambda x: x[:, 0]), "target_logits must be"),
)


# ----------------------------------------------------------------------------------- linear, norms

def linear_base() -> dict:
    g = generator(9)
    return {"x": torch.randn(5, 24, generator=g), "weight": torch.randn(7, 24, generator=g)}


LINEAR_ROWS = (
    Row("contiguous float32", linear_base),
    Row("x with a stride over K (a transposed tensor)",
        variant(linear_base, x=lambda x: x.t().contiguous().t())),
    Row("weight with a stride over K", variant(linear_base, weight=strided)),
    Row("bfloat16 x and weight", variant(linear_base, x=bf16, weight=bf16)),
    Row("a bfloat16 weight for float32 x", variant(linear_base, weight=bf16),
        "linear: weight must be of x's dtype float32, got bfloat16 tensor"),
    Row("weight for another K", variant(linear_base, weight=lambda w: w[:, :20]),
        "weight must be a float32, bfloat16 or float16 tensor of shape [N, K] = [*, 24]"),
    Row("1-D x", variant(linear_base, x=lambda x: x[0]),
        "x must be a float32, bfloat16 or float16 tensor of shape [M, K]"),
    Row("float64 x and weight", variant(linear_base, x=lambda x: x.double(), weight=lambda w: w.double()),
        "x must be a float32, bfloat16 or float16 tensor"),
)


def rms_norm_base() -> dict:
    g = generator(10)
    return {"x": torch.randn(3, 20, generator=g), "weight": torch.randn(20, generator=g), "eps": 1e-6}


RMS_NORM_ROWS = (
    Row("contiguous float32", rms_norm_base),
    Row("x with a stride over H", variant(rms_norm_base, x=lambda x: x.t().contiguous().t())),
    Row("weight with a stride", variant(rms_norm_base, weight=strided)),
    Row("bfloat16 x with a float32 weight", variant(rms_norm_base, x=bf16)),
    Row("zero_centered=False", variant(rms_norm_base, zero_centered=False)),
    Row("weight for another H", variant(rms_norm_base, weight=lambda w: w[:16]),
        "rms_norm: weight must be a float32, bfloat16 or float16 tensor of shape [H] = [20]"),
    Row("eps None", variant(rms_norm_base, eps=None), "eps must be a float, got None"),
    Row("zero_centered as 1", variant(rms_norm_base, zero_centered=1), "zero_centered must be True or False"),
    Row("integer x", variant(rms_norm_base, x=lambda x: x.int()), "x must be a float32"),
)


def gated_rms_norm_base() -> dict:
    g = generator(11)
    return {"x": torch.randn(3, 2, 16, generator=g), "z": torch.randn(3, 2, 16, generator=g),
            "weight": torch.randn(16, generator=g), "eps": 1e-6}


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """The same values, stored head-major (a non-contiguous [M, Hv, Dv] view)."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


GATED_RMS_NORM_ROWS = (
    Row("contiguous float32", gated_rms_norm_base),
    Row("x and z stored head-major", variant(gated_rms_norm_base, x=heads_first, z=heads_first)),
    Row("x and z with a stride over Dv", variant(gated_rms_norm_base, x=strided, z=strided)),
    Row("weight with a stride", variant(gated_rms_norm_base, weight=strided)),
    Row("bfloat16 x, z with a float32 weight", variant(gated_rms_norm_base, x=bf16, z=bf16)),
    Row("bfloat16 x, z and weight", variant(gated_rms_norm_base, x=bf16, z=bf16, weight=bf16)),
    Row("z of another shape", variant(gated_rms_norm_base, z=lambda z: z[:, :1]),
        "z must be a float32, bfloat16 or float16 tensor of shape [M, Hv, Dv] = [3, 2, 16]"),
    Row("a weight over Hv * Dv", variant(gated_rms_norm_base, weight=lambda w: w.repeat(2)),
        "weight must be a float32, bfloat16 or float16 tensor of shape [Dv] = [16]"),
    Row("float64 z", variant(gated_rms_norm_base, z=lambda z: z.double()), "z must be a float32"),
)


def group_norm_base() -> dict:
    g = generator(15)
    return {"x": torch.randn(3, 24, generator=g), "z": torch.randn(3, 24, generator=g),
            "weight": torch.randn(24, generator=g), "eps": 1e-5, "group_size": 8}


GATED_GROUP_RMS_NORM_ROWS = (
    Row("contiguous float32", group_norm_base),
    Row("one group", variant(group_norm_base, group_size=24)),
    Row("x and z with a stride over I", variant(group_norm_base, x=strided, z=strided)),
    Row("x stored column-major", variant(group_norm_base, x=lambda x: x.t().contiguous().t())),
    Row("bfloat16 x, z with a float32 weight", variant(group_norm_base, x=bf16, z=bf16)),
    Row("a group size that does not divide I", variant(group_norm_base, group_size=7),
        "gated_group_rms_norm: group_size must be a divisor of I = 24, got 7"),
    Row("group_size 0", variant(group_norm_base, group_size=0), "group_size must be an int >= 1, got 0"),
    Row("3-D x", variant(group_norm_base, x=lambda x: x.view(3, 3, 8)),
        "x must be a float32, bfloat16 or float16 tensor of shape [M, I]"),
    Row("a weight per group", variant(group_norm_base, weight=lambda w: w[:8]),
        "weight must be a float32, bfloat16 or float16 tensor of shape [I] = [24]"),
)


def relu2_base() -> dict:
    return {"x": torch.randn(4, 20, generator=generator(16))}


RELU2_ROWS = (
    Row("contiguous float32", relu2_base),
    Row("bfloat16 x with a stride over rows", variant(relu2_base, x=lambda x: bf16(x)[::2])),
    Row("x with a stride over H", variant(relu2_base, x=strided)),
    Row("float64 x", variant(relu2_base, x=lambda x: x.double()), "relu2: x must be a float32"),
    Row("1-D x", variant(relu2_base, x=lambda x: x[0]),
        "x must be a float32, bfloat16 or float16 tensor of shape"),
)


def silu_mul_base() -> dict:
    g = generator(17)
    return {"gate": 3 * torch.randn(4, 20, generator=g), "up": torch.randn(4, 20, generator=g)}


def one_projection(inputs: dict) -> None:
    """gate and up as the bfloat16 halves of one [M, 2I] projection: a row stride of 2I."""
    inputs["gate"], inputs["up"] = bf16(torch.cat([inputs["gate"], inputs["up"]], 1)).split(20, 1)


SILU_MUL_ROWS = (
    Row("contiguous float32", silu_mul_base),
    Row("bfloat16 halves of one projection (a row stride)", variant(silu_mul_base, one_projection)),
    Row("gate with a stride over I", variant(silu_mul_base, gate=strided)),
    Row("bfloat16 up with a float32 gate", variant(silu_mul_base, up=bf16),
        "silu_mul: up must be gate's dtype (float32), got bfloat16"),
    Row("up of another width", variant(silu_mul_base, up=lambda u: u[:, :19]), "silu_mul: up must be"),
)


def gdn_gating_base() -> dict:
    g = generator(18)
    return {"a_log": torch.randn(3, generator=g), "a": 4 * torch.randn(5, 3, generator=g),
            "dt_bias": torch.randn(3, generator=g), "b": 4 * torch.randn(5, 3, generator=g)}


GDN_GATING_ROWS = (
    Row("float32 parameters and projections", gdn_gating_base),
    Row("bfloat16 projections with a row stride", variant(gdn_gating_base, a=lambda a: bf16(a)[::2],
                                                          b=lambda b: bf16(b)[::2])),
    Row("bfloat16 parameters, a with a stride over Hv", variant(gdn_gating_base, a_log=bf16, a=strided)),
    Row("b with other heads", variant(gdn_gating_base, b=lambda b: b[:, :2]), "gdn_gating: b must be"),
    Row("dt_bias as [1, Hv]", variant(gdn_gating_base, dt_bias=lambda d: d[None]),
        "gdn_gating: dt_bias must be"),
    Row("int64 a", variant(gdn_gating_base, a=long), "gdn_gating: a must be a float32"),
)


def rotary_base() -> dict:
    g = generator(19)
    return {"q": torch.randn(3, 2, 12, generator=g), "k": torch.randn(3, 1, 12, generator=g),
            "positions": torch.tensor([0, 5, 300]), "rotary_dim": 8, "theta": 10000.0}


ROTARY_ROWS = (
    Row("contiguous float32, a partial rotation", rotary_base),
    Row("bfloat16, int32 positions", variant(rotary_base, q=bf16, k=bf16, positions=lambda p: p.int())),
    Row("q with a stride over heads", variant(rotary_base, q=lambda q: torch.cat([q, q], 2)[..., :12])),
    Row("q with a stride over D", variant(rotary_base, q=strided)),
    Row("k of another head width", variant(rotary_base, k=lambda k: k[..., :10]),
        "rotary_embedding: k must be"),
    Row("an odd rotary_dim", variant(rotary_base, rotary_dim=5),
        "rotary_embedding: rotary_dim must be an even int from 2 to D = 12, got 5"),
    Row("float positions", variant(rotary_base, positions=lambda p: p.float()),
        "rotary_embedding: positions must be an int32 or int64 tensor"),
)


# --------------------------------------------------------------------------------------------- MoE

def moe_base() -> dict:
    g = generator(12)
    weights, ids = kernels.moe_route(torch.randn(3, 3, generator=g), 2, True)
    return {"x": torch.randn(3, 16, generator=g), "w13": 0.2 * torch.randn(3, 16, 16, generator=g),
            "w2": 0.2 * torch.randn(3, 16, 8, generator=g), "topk_weights": weights, "topk_ids": ids}


def relu2_experts(inputs: dict) -> None:
    """Nemotron-H's non-gated experts: w13 holds the up rows only ([E, I, H])."""
    inputs["w13"] = inputs["w13"][:, :8].contiguous()
    inputs["activation"] = "relu2"


MOE_ROWS = (
    Row("the engines' form: int32 ids, float32, contiguous", moe_base),
    Row("relu2 experts", variant(moe_base, relu2_experts)),
    Row("relu2 experts, int64 ids, strided x", variant(moe_base, relu2_experts, topk_ids=long, x=strided)),
    Row("relu2 experts with a gated w13", variant(moe_base, activation="relu2"),
        "w2 must be a float32, bfloat16 or float16 tensor of shape [E, H, I] = [3, 16, 16]"),
    Row("activation 'gelu'", variant(moe_base, activation="gelu"),
        "fused_moe: activation must be one of ('silu', 'relu2'), got 'gelu'"),
    Row("int64 topk_ids", variant(moe_base, topk_ids=long)),
    Row("x with a stride over H", variant(moe_base, x=strided)),
    Row("w13 and w2 with a stride over their last dim", variant(moe_base, w13=strided, w2=strided)),
    Row("topk_weights with a stride", variant(moe_base, topk_weights=strided)),
    Row("bfloat16 topk_weights for float32 x", variant(moe_base, topk_weights=bf16)),
    Row("bfloat16 x and weights", variant(moe_base, x=bf16, w13=bf16, w2=bf16)),
    Row("w2 for another I", variant(moe_base, w2=lambda w: w[..., :7]),
        "w2 must be a float32, bfloat16 or float16 tensor of shape [E, H, I] = [3, 16, 8]"),
    Row("an odd 2I", variant(moe_base, w13=lambda w: w[:, :15]), "w13 must be a tensor with an even 2I"),
    Row("bfloat16 x for float32 weights", variant(moe_base, x=bf16), "w13 must be of x's dtype bfloat16"),
    Row("topk_weights of another K", variant(moe_base, topk_weights=lambda w: w[:, :1]),
        "topk_weights must be a float32, bfloat16 or float16 tensor of shape [T, K] = [3, 2]"),
    Row("float topk_ids", variant(moe_base, topk_ids=lambda x: x.float()),
        "topk_ids must be an int32 or int64"),
)


def route_base() -> dict:
    return {"router_logits": torch.randn(4, 6, generator=generator(13)), "top_k": 2, "renormalize": True}


ROUTE_ROWS = (
    Row("float32 logits", route_base),
    Row("bfloat16 logits", variant(route_base, router_logits=bf16)),
    Row("top_k = E", variant(route_base, top_k=6, renormalize=False)),
    Row("top_k 0", variant(route_base, top_k=0), "moe_route: top_k must be an int from 1 to 6, got 0"),
    Row("top_k over E", variant(route_base, top_k=7), "top_k must be an int from 1 to 6, got 7"),
    Row("top_k 2.0", variant(route_base, top_k=2.0), "top_k must be an int from 1 to 6, got 2.0"),
    Row("renormalize None", variant(route_base, renormalize=None), "renormalize must be True or False"),
    Row("1-D logits", variant(route_base, router_logits=lambda x: x[0]), "router_logits must be"),
)


def sigmoid_route_base() -> dict:
    g = generator(17)
    return {"router_logits": torch.randn(4, 8, generator=g), "correction_bias": torch.randn(8, generator=g),
            "top_k": 2, "n_group": 2, "topk_group": 1, "renormalize": True, "routed_scaling_factor": 2.5}


SIGMOID_ROUTE_ROWS = (
    Row("float32 logits, grouped", sigmoid_route_base),
    Row("one group, no renormalisation", variant(sigmoid_route_base, n_group=1, renormalize=False, top_k=8)),
    Row("bfloat16 logits", variant(sigmoid_route_base, router_logits=bf16)),
    Row("n_group 3", variant(sigmoid_route_base, n_group=3), "n_group must be a divisor of E = 8, got 3"),
    Row("topk_group over n_group", variant(sigmoid_route_base, topk_group=3),
        "topk_group must be an int from 1 to 2, got 3"),
    Row("top_k over the kept groups' experts", variant(sigmoid_route_base, top_k=5),
        "top_k must be an int from 1 to 4, got 5"),
    Row("a bias per group", variant(sigmoid_route_base, correction_bias=lambda b: b[:2]),
        "correction_bias must be a float32, bfloat16 or float16 tensor of shape [E] = [8]"),
    Row("routed_scaling_factor None", variant(sigmoid_route_base, routed_scaling_factor=None),
        "routed_scaling_factor must be a float, got None"),
)


# ------------------------------------------------------------------------------------------ Mamba2

def mamba_inputs(seed: int, h: int = 2, p: int = 4, g: int = 1, n: int = 8, lens=(2, 0, 3)) -> dict:
    """Rows of the given lengths (one empty), a pool of four slots, int32 indices, float32 tensors."""
    gen = generator(seed)
    t = sum(lens)
    return {
        "x": torch.randn(t, h, p, generator=gen), "dt": F.softplus(torch.randn(t, h, generator=gen)),
        "A": -torch.rand(h, generator=gen), "B": torch.randn(t, g, n, generator=gen),
        "C": torch.randn(t, g, n, generator=gen), "D": torch.randn(h, generator=gen),
        "ssm_state": 0.5 * torch.randn(4, h, p, n, generator=gen), **slot_inputs(lens),
    }


def ssu_base() -> dict:
    return {**mamba_inputs(18), "has_initial_state": torch.tensor([True, False, True])}


def mamba_groups(inputs: dict) -> None:
    """Four heads in two groups."""
    fresh = mamba_inputs(19, h=4, g=2)
    inputs.update({name: fresh[name] for name in ("x", "dt", "A", "B", "C", "D", "ssm_state")})


def mamba_common_rows(base: Callable[[], dict]) -> tuple[Row, ...]:
    """Rows both Mamba2 ops share."""
    return (
        Row("the engines' form: int32 indices, float32, contiguous", base),
        *slot_rows(base, accepted=slow),
        Row("bfloat16 x, B, C", variant(base, x=bf16, B=bf16, C=bf16)),
        slow(Row("bfloat16 dt and D", variant(base, dt=bf16, D=bf16))),
        slow(Row("bfloat16 ssm_state pool", variant(base, ssm_state=bf16))),
        Row("x, B, C with a stride over their last dim", variant(base, x=strided, B=strided, C=strided)),
        slow(Row("dt with a stride over heads", variant(base, dt=strided))),
        slow(Row("A and D with a stride", variant(base, A=strided, D=strided))),
        Row("ssm_state with a stride over N (a view of a wider pool)", variant(base, ssm_state=strided)),
        slow(Row("heads in groups (H a multiple of G)", variant(base, mamba_groups))),
        Row("float64 x", variant(base, x=lambda x: x.double()),
            "x must be a float32, bfloat16 or float16 tensor of shape [T, H, P], got float64"),
        Row("H not a multiple of G", variant(base, mamba_groups, B=lambda b: b.repeat(1, 3, 1)[:, :3],
                                             C=lambda c: c.repeat(1, 3, 1)[:, :3]),
            "x must be a tensor whose H is a multiple of G = 3, got H = 4"),
        Row("C with another state size", variant(base, C=lambda c: c[..., :6]),
            "C must be a float32, bfloat16 or float16 tensor of shape [T, G, Ns] = [5, 1, 8]"),
        Row("dt of shape [T]", variant(base, dt=lambda d: d[:, 0]), "dt must be"),
        Row("A per token", variant(base, A=lambda a: a.expand(5, -1)), "A must be"),
        Row("ssm_state with another P", variant(base, ssm_state=lambda s: s[:, :, :3]),
            "ssm_state must be a float32, bfloat16 or float16 tensor of shape [S, H, P, Ns] = [*, 2, 4, 8]"),
        Row("a state of N = 264",
            variant(base, B=lambda b: b.repeat(1, 1, 33), C=lambda c: c.repeat(1, 1, 33)),
            "B must be a tensor with Ns <= 256 (the kernels' limit), got Ns = 264"),
        Row("D on another device", variant(base, D=on_meta), "D must be on the device of the other inputs"),
    )


SSU_ROWS = mamba_common_rows(ssu_base) + speculative_rows(ssu_base)


def ssd_base() -> dict:
    return {**ssu_base(), "chunk_size": 16, "start_positions": torch.tensor([14, 0, 3], dtype=torch.int32)}


def ssd_blocks(inputs: dict) -> None:
    """States at block boundaries of 16 tokens: row 0 (positions 14, 15) crosses 16 into slot 3."""
    inputs["block_size"] = 16
    inputs["block_state_indices"] = torch.tensor([[3, PAD_SLOT_ID], [PAD_SLOT_ID] * 2, [PAD_SLOT_ID] * 2],
                                                 dtype=torch.int64)


def mamba_huge_prefill(inputs: dict) -> None:
    """Over a million tokens (stride-0 views: the contract reads shapes only)."""
    t = 1 << 20
    for name in ("x", "dt", "B", "C"):
        inputs[name] = inputs[name][:1].expand(t, *inputs[name].shape[1:])
    inputs["cu_seqlens"] = torch.tensor([0, 1, 1, t], dtype=torch.int32)


SSD_ROWS = mamba_common_rows(ssd_base) + (
    slow(Row("chunk_size 128, no start positions", variant(ssd_base, chunk_size=128, start_positions=None))),
    slow(Row("int64 start positions", variant(ssd_base, start_positions=long))),
    Row("states at block boundaries, int64 block_state_indices", variant(ssd_base, ssd_blocks)),
    Row("chunk_size 256", variant(ssd_base, chunk_size=256),
        "chunk_size must be one of (16, 32, 64, 128), got 256"),
    Row("start positions for another row count", variant(ssd_base, start_positions=lambda s: s[:2]),
        "start_positions must be an int32 or int64 tensor of shape [N] = [3]"),
    Row("2-D state_indices", variant(ssd_base, state_indices=lambda x: x[:, None]),
        "state_indices must be an int32 or int64 tensor of shape [N] = [3], got"),
    Row("block_size not a multiple of chunk_size", variant(ssd_base, ssd_blocks, block_size=24),
        "block_size must be a multiple of chunk_size = 16 (block boundaries are chunk ends), got 24"),
    Row("block_size without block_state_indices", variant(ssd_base, ssd_blocks, block_state_indices=None),
        "block_state_indices must be an int32 or int64 tensor of shape [N, M] with block_size, got None"),
    Row("block_state_indices without block_size", variant(ssd_base, ssd_blocks, block_size=None),
        "block_state_indices must be None without block_size"),
    Row("1-D block_state_indices", variant(ssd_base, ssd_blocks, block_state_indices=lambda b: b[:, 0]),
        "block_state_indices must be an int32 or int64 tensor of shape [N, M]"),
    Row("more chunks than a CUDA grid axis takes", variant(ssd_base, mamba_huge_prefill),
        "x must be short enough that T // chunk_size + 2 N <= 65535"),
)


# -------------------------------------------------------------------------------------- input prep

PREPARE_ARGS = ("idx_mapping", "query_start_loc", "is_decode", "num_computed", "last_sampled", "draft_tokens",
                "token_ids", "block_table", "block_size", "num_tokens_padded")
POST_ARGS = ("idx_mapping", "query_lens", "num_draft_tokens", "is_sampling", "sampled", "num_valid",
             "num_computed", "num_valid_state", "last_sampled", "token_ids", "num_tokens")


def prepare_base() -> dict:
    state, step = build("k3-bs4")
    both = {**state, **step}
    return {name: both[name] for name in PREPARE_ARGS}


def post_base() -> dict:
    state, step = build("k3-bs4")
    both = {**state, **step}
    return {name: both[name] for name in POST_ARGS}


def int32(x):
    return x.int()


PREPARE_ROWS = (
    Row("the engines' form", prepare_base),
    Row("int64 idx_mapping, query_start_loc, num_computed, block_table",
        variant(prepare_base, idx_mapping=long, query_start_loc=long, num_computed=long, block_table=long)),
    Row("int32 last_sampled, draft_tokens, token_ids",
        variant(prepare_base, last_sampled=int32, draft_tokens=int32, token_ids=int32)),
    Row("strided token_ids, block_table, idx_mapping",
        variant(prepare_base, token_ids=strided, block_table=strided, idx_mapping=strided)),
    Row("float idx_mapping", variant(prepare_base, idx_mapping=lambda x: x.float()),
        "prepare_inputs: idx_mapping must be an int32 or int64 tensor of shape [N]"),
    Row("query_start_loc for another row count", variant(prepare_base, query_start_loc=lambda x: x[:-1]),
        "query_start_loc must be an int32 or int64 tensor of shape [N+1] = [9]"),
    Row("integer is_decode", variant(prepare_base, is_decode=int32),
        "is_decode must be a bool tensor of shape [N] = [8]"),
    Row("block_table for other request slots", variant(prepare_base, block_table=lambda x: x[:-1]),
        "block_table must be an int32 or int64 tensor of shape [R, max_blocks] = [11, *]"),
    Row("block_size 0", variant(prepare_base, block_size=0), "block_size must be an int >= 1, got 0"),
    Row("num_tokens_padded -1", variant(prepare_base, num_tokens_padded=-1),
        "num_tokens_padded must be an int >= 0"),
)

POST_ROWS = (
    Row("the engines' form", post_base),
    Row("int64 row tensors", variant(post_base, idx_mapping=long, query_lens=long, num_draft_tokens=long,
                                     num_valid=long)),
    Row("int64 counters updated in place",
        variant(post_base, num_computed=long, num_valid_state=long, num_tokens=long)),
    Row("int32 token tensors updated in place", variant(post_base, last_sampled=int32, token_ids=int32)),
    Row("int32 sampled", variant(post_base, sampled=int32)),
    Row("token_ids with a stride (written through a copy)", variant(post_base, token_ids=strided)),
    Row("strided num_computed and sampled", variant(post_base, num_computed=strided, sampled=strided)),
    Row("float num_valid", variant(post_base, num_valid=lambda x: x.float()),
        "post_update: num_valid must be an int32 or int64 tensor of shape [N] = [8]"),
    Row("sampled without columns", variant(post_base, sampled=lambda x: x[:, :0]),
        "sampled must be a tensor with K+1 >= 1, got K+1 = 0"),
    Row("num_tokens for other request slots", variant(post_base, num_tokens=lambda x: x[:-1]),
        "num_tokens must be an int32 or int64 tensor of shape [R] = [11]"),
    Row("integer is_sampling", variant(post_base, is_sampling=int32), "is_sampling must be a bool tensor"),
)


def _route(*, backend, **inputs):
    return kernels.moe_route(**inputs)


def _sigmoid_route(*, backend, **inputs):
    return kernels.moe_route_sigmoid(**inputs)


OPS = {
    "fused_recurrent_gated_delta_rule": Op(kernels.fused_recurrent_gated_delta_rule, RECURRENT_ROWS, 2e-3),
    "chunk_gated_delta_rule": Op(kernels.chunk_gated_delta_rule, CHUNK_ROWS, 5e-3),
    "causal_conv1d_fn": Op(kernels.causal_conv1d_fn, CONV_FN_ROWS, 2e-3),
    "causal_conv1d_update": Op(kernels.causal_conv1d_update, CONV_UPDATE_ROWS, 2e-3),
    "paged_attention": Op(kernels.paged_attention, ATTENTION_ROWS, 2e-3),
    # Copies, exact in float32; a float32 value stored into a bfloat16 cache is rounded by torch and
    # truncated by the Triton interpreter (a compiled kernel rounds), hence a ratio rather than bitwise.
    "reshape_and_cache": Op(kernels.reshape_and_cache, KV_CACHE_ROWS, 1e-6),
    "greedy_verify": Op(kernels.greedy_verify, VERIFY_ROWS, 0.0),
    "linear": Op(kernels.linear, LINEAR_ROWS, 2e-3),
    "rms_norm": Op(kernels.rms_norm, RMS_NORM_ROWS, 2e-3),
    "gated_rms_norm": Op(kernels.gated_rms_norm, GATED_RMS_NORM_ROWS, 2e-3),
    "fused_moe": Op(kernels.fused_moe, MOE_ROWS, 2e-3),
    # One implementation on every device: its contract is checked once.
    "moe_route": Op(_route, ROUTE_ROWS, 0.0, backends=("torch",)),
    "moe_route_sigmoid": Op(_sigmoid_route, SIGMOID_ROUTE_ROWS, 0.0, backends=("torch",)),
    "selective_state_update": Op(kernels.selective_state_update, SSU_ROWS, 2e-3),
    "ssd_chunk_scan": Op(kernels.ssd_chunk_scan, SSD_ROWS, 5e-3),
    "gated_group_rms_norm": Op(kernels.gated_group_rms_norm, GATED_GROUP_RMS_NORM_ROWS, 2e-3),
    "relu2": Op(kernels.relu2, RELU2_ROWS, 2e-3),
    "silu_mul": Op(kernels.silu_mul, SILU_MUL_ROWS, 2e-3),
    "gdn_gating": Op(kernels.gdn_gating, GDN_GATING_ROWS, 2e-3),
    "rotary_embedding": Op(kernels.rotary_embedding, ROTARY_ROWS, 2e-3),
    "prepare_inputs": Op(kernels.input_prep.prepare_inputs, PREPARE_ROWS, 0.0),
    "post_update": Op(kernels.input_prep.post_update, POST_ROWS, 0.0),
}


# ------------------------------------------------------------------------------------------- tests

def _tensors(x) -> list[torch.Tensor]:
    """The tensors of an op's result (None, a tensor or a tuple of them)."""
    if x is None:
        return []
    return [x] if isinstance(x, torch.Tensor) else list(x)


def assert_same(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float) -> None:
    """Same dtype and shape; integers (and every tensor when ``ratio == 0``) bitwise, floats to ``ratio``
    (16-bit ones to LOWP_RATIO)."""
    assert (got.dtype, got.shape) == (ref.dtype, ref.shape), f"{name}: {got.dtype} {list(got.shape)}"
    if ratio == 0.0 or not ref.is_floating_point():
        assert torch.equal(ref, got), f"{name}: the backends differ"
    else:
        assert_close(name, ref.float(), got.float(), ratio if ref.dtype == torch.float32 else LOWP_RATIO)


def run_accepted(op: Op, row: Row) -> None:
    """Every backend runs the row; outputs and in-place updates agree with the first backend's."""
    runs = {}
    for backend in op.backends:
        inputs = row.make()
        runs[backend] = (_tensors(op.fn(**inputs, backend=backend)), inputs)
    (ref_out, ref_in), *others = runs.values()
    for backend, (out, inputs) in zip(op.backends[1:], others):
        assert len(out) == len(ref_out)
        for i, (a, b) in enumerate(zip(ref_out, out)):
            assert_same(f"{backend} output {i}", a, b, op.ratio)
        for name, value in ref_in.items():
            if isinstance(value, torch.Tensor):
                assert_same(f"{backend} {name} after the call", value, inputs[name], op.ratio)


def run_refused(op: Op, name: str, row: Row) -> None:
    """Every backend raises the same KernelInputError, containing ``row.expected``, and changes nothing."""
    messages = set()
    for backend in op.backends:
        inputs = row.make()
        with pytest.raises(KernelInputError) as info:
            op.fn(**inputs, backend=backend)
        message = str(info.value)
        assert message.startswith(f"{name}: ") and row.expected in message, message
        messages.add(message)
        for arg, before in row.make().items():
            if isinstance(before, torch.Tensor) and before.device.type != "meta":
                assert torch.equal(inputs[arg], before), f"{backend} changed {arg} before refusing"
    assert len(messages) == 1, f"the backends refuse with different messages: {messages}"


CASES = [pytest.param(name, row, id=f"{name}: {row.what}", marks=[pytest.mark.slow] if row.slow else [])
         for name, op in OPS.items() for row in op.rows]


@requires_triton
@pytest.mark.parametrize("name,row", CASES)
def test_both_backends_keep_the_contract(name, row):
    op = OPS[name]
    if row.expected == ACCEPTED:
        run_accepted(op, row)
    else:
        run_refused(op, name, row)


def exported_ops() -> set[str]:
    """Every op a user can call: the functions ``kernels`` exports, and the async engine's step ops."""
    ops = {n for n in kernels.__all__ if inspect.isfunction(getattr(kernels, n))}
    return ops | {n for n in kernels.input_prep.__all__ if not n.startswith("naive_")}


def test_every_exported_op_has_a_contract_table():
    assert set(OPS) == exported_ops(), "an op without a contract table (or a table for no op)"
    for name, op in OPS.items():
        kinds = {row.expected == ACCEPTED for row in op.rows}
        assert kinds == {True, False}, f"{name}: a table needs accepted and refused rows"
        assert op.rows[0].expected == ACCEPTED, f"{name}: the first row is the form the engines pass"


def test_the_error_names_the_op_the_argument_what_was_expected_and_what_was_given():
    inputs = recurrent_base()
    inputs["state_indices"] = inputs["state_indices"].short()
    with pytest.raises(KernelInputError) as info:
        kernels.fused_recurrent_gated_delta_rule(**inputs, backend="torch")
    err = info.value
    assert str(err) == (
        "fused_recurrent_gated_delta_rule: state_indices must be an int32 or int64 tensor of shape [N] = [3] "
        f"or [N, K+1] = [3, *], got int16 tensor of shape [3] on {inputs['state_indices'].device}")
    assert isinstance(err, ValueError)
    assert (err.op, err.arg) == ("fused_recurrent_gated_delta_rule", "state_indices")
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


# The Triton modules whose kernels the ops launch, and inputs an op consumes with torch ops on the device
# before launching (fused_moe sorts its (token, slot) pairs by expert id).
TRITON_MODULES = (
    "activation.triton_relu2",
    "activation.triton_silu_mul",
    "attention.triton_paged_attention",
    "conv1d.triton_conv1d",
    "gated_delta_rule.triton_chunk_cumsum",
    "gated_delta_rule.triton_chunk_output",
    "gated_delta_rule.triton_chunk_solve",
    "gated_delta_rule.triton_chunk_state",
    "gated_delta_rule.triton_chunk_wy",
    "gated_delta_rule.triton_recurrent",
    "gdn_gating.triton_gdn_gating",
    "input_prep.triton_input_prep",
    "kv_cache.triton_kv_cache",
    "linear.triton_linear",
    "mamba2.triton_chunk_scan",
    "mamba2.triton_state_update",
    "moe.triton_moe",
    "norm.triton_rms_norm",
    "rotary.triton_rotary",
    "verify.triton_greedy_verify",
)
NOT_LAUNCHED = {"fused_moe": {"topk_ids"}}


class LaunchRecorder:
    """Stands in for a Triton kernel: ``kernel[grid](*args)`` records the arguments and runs nothing."""

    def __init__(self, launched: list):
        self.launched = launched

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.extend([*args, *kwargs.values()])


@requires_triton
@pytest.mark.parametrize("name", [n for n, op in OPS.items() if "triton" in op.backends])
def test_the_engines_form_reaches_the_kernels_without_a_copy(name, monkeypatch):
    """Conversions cost only the callers that need them: the tensors of the engines' form (each table's
    first row) are handed to the kernels themselves, pools and caches updated in place, nothing copied."""
    from triton.runtime.jit import KernelInterface  # compiled, interpreted and heuristics-wrapped kernels

    launched: list = []
    for module_name in TRITON_MODULES:
        module = importlib.import_module(f"kernels.{module_name}")
        for attr, value in vars(module).items():
            if isinstance(value, KernelInterface):
                monkeypatch.setattr(module, attr, LaunchRecorder(launched))
    inputs = OPS[name].rows[0].make()
    OPS[name].fn(**inputs, backend="triton")
    assert launched, f"{name}: no kernel launched"
    for arg, value in inputs.items():
        if isinstance(value, torch.Tensor) and arg not in NOT_LAUNCHED.get(name, ()):
            assert any(a is value for a in launched), f"{name}: {arg} reached the kernel as a copy"
