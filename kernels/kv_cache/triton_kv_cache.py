"""Triton kernel for ``reshape_and_cache``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._contract import as_index, write_back
from kernels.constants import PAD_SLOT_ID
from kernels.kv_cache.contract import check_reshape_and_cache_inputs


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


def slot_contiguous(t: torch.Tensor) -> bool:
    """Whether the ``[Hkv, D]`` values of one token (or cache slot) lie contiguous,
    as the kernel reads them."""
    hkv, d = t.shape[-2:]
    return (d <= 1 or t.stride(-1) == 1) and (hkv <= 1 or t.stride(-2) == d)


def kernel_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches the kernel writes: the caches themselves when each slot is contiguous and both share
    strides (the engines' caches), else row-major copies, written back after the launch."""
    if slot_contiguous(k_cache) and k_cache.stride() == v_cache.stride():
        return k_cache, v_cache
    return (k_cache.clone(memory_format=torch.contiguous_format),
            v_cache.clone(memory_format=torch.contiguous_format))


def triton_reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton wrapper; same contract as ``kernels.kv_cache.reshape_and_cache``."""
    check_reshape_and_cache_inputs(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, hkv, d = k.shape
    if num_tokens == 0:
        return
    k, v = (t if slot_contiguous(t) else t.contiguous() for t in (k, v))
    slot_mapping = as_index(slot_mapping, torch.int64)
    k_work, v_work = kernel_caches(k_cache, v_cache)
    for name, t in (("k", k), ("v", v), ("k_cache", k_work), ("v_cache", v_work)):
        assert slot_contiguous(t), f"{name}: [Hkv, D] must be contiguous"
    assert k_work.stride() == v_work.stride(), "the kernel addresses both caches with one set of strides"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous(), "slot_mapping: int64"
    reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_work, v_work, slot_mapping,
        k.stride(0), v.stride(0), k_work.stride(0), k_work.stride(1),
        BLOCK_SIZE=k_cache.shape[1], HD=hkv * d, BHD=triton.next_power_of_2(hkv * d), PAD_ID=PAD_SLOT_ID,
    )
    write_back(k_cache, k_work)
    write_back(v_cache, v_work)
