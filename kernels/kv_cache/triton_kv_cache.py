"""Triton kernel for ``reshape_and_cache``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.constants import PAD_SLOT_ID


@triton.jit
def reshape_and_cache_kernel(
    k, v, k_cache, v_cache, slot_mapping,
    stride_kt, stride_vt, stride_cb, stride_cs,
    BLOCK_SIZE: tl.constexpr, HD: tl.constexpr, BHD: tl.constexpr, PAD_ID: tl.constexpr,
):
    # One program per token; its Hkv * D values are contiguous in k, v and in a cache slot.
    i_t = tl.program_id(0)
    slot = tl.load(slot_mapping + i_t)
    if slot == PAD_ID:
        return
    o_hd = tl.arange(0, BHD)
    mask_hd = o_hd < HD
    i_blk, i_off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    b_k = tl.load(k + i_t * stride_kt + o_hd, mask=mask_hd, other=0.0)
    b_v = tl.load(v + i_t * stride_vt + o_hd, mask=mask_hd, other=0.0)
    p_slot = i_blk * stride_cb + i_off * stride_cs + o_hd
    tl.store(k_cache + p_slot, b_k.to(k_cache.dtype.element_ty), mask=mask_hd)
    tl.store(v_cache + p_slot, b_v.to(v_cache.dtype.element_ty), mask=mask_hd)


def triton_reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    assert k.dim() == 3 and v.shape == k.shape, "reshape_and_cache: k, v [T, Hkv, D]"
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, "caches [num_blocks, block_size, Hkv, D]"
    assert k_cache.shape[2:] == k.shape[1:], f"cache {tuple(k_cache.shape)} does not fit k {tuple(k.shape)}"
    assert slot_mapping.shape == (k.shape[0],) and slot_mapping.dtype == torch.int64, "slot_mapping int64 [T]"
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share strides"
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        # The [Hkv, D] values of one token / one slot must be contiguous.
        assert t.stride(-1) == 1 and t.stride(-2) == t.shape[-1], f"{name}: [Hkv, D] must be contiguous"
    num_tokens, hkv, d = k.shape
    if num_tokens == 0:
        return
    reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), v.stride(0), k_cache.stride(0), k_cache.stride(1),
        BLOCK_SIZE=k_cache.shape[1], HD=hkv * d, BHD=triton.next_power_of_2(hkv * d), PAD_ID=PAD_SLOT_ID,
    )
