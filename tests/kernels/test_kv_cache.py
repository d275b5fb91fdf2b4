"""reshape_and_cache: exact checks against explicit loops, sentinel-filled
caches (nothing outside the mapping is touched), PAD_SLOT_ID handling, Triton == torch."""

from __future__ import annotations

import pytest
import torch

from kernels.constants import PAD_SLOT_ID
from kernels.kv_cache import reshape_and_cache
from tests.kernels.conftest import requires_triton

HUGE = 1e30
BACKENDS = ["torch", pytest.param("triton", marks=requires_triton)]


def make_cache(num_blocks, block_size, hkv, d, dtype):
    return torch.full((num_blocks, block_size, hkv, d), HUGE, dtype=dtype), torch.full(
        (num_blocks, block_size, hkv, d), -HUGE, dtype=dtype
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "block_size, hkv, d",
    [(4, 2, 12), (16, 1, 20), (16, 4, 16)],
    ids=["bs4-h2-d12", "bs16-h1-d20", "bs16-h4-d16"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reshape_and_cache(block_size, hkv, d, dtype, backend):
    num_blocks, num_tokens = 7, 13
    k_cache, v_cache = make_cache(num_blocks, block_size, hkv, d, dtype)
    k, v = torch.randn(num_tokens, hkv, d).to(dtype), torch.randn(num_tokens, hkv, d).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 5, 12]] = PAD_SLOT_ID  # padding tokens, including the last one
    reshape_and_cache(k, v, k_cache, v_cache, slots, backend=backend)

    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s == PAD_SLOT_ID:
            continue
        written[s] = True
        assert torch.equal(k_cache[s // block_size, s % block_size], k[t]), f"token {t} key"
        assert torch.equal(v_cache[s // block_size, s % block_size], v[t]), f"token {t} value"
    untouched = ~written.view(num_blocks, block_size)
    assert torch.all(k_cache[untouched] == HUGE) and torch.all(v_cache[untouched] == -HUGE)


@requires_triton
def test_reshape_and_cache_triton_matches_torch_on_strided_tokens():
    # k, v as views into a fused qkv activation: rows strided, [Hkv, D] contiguous.
    block_size, hkv, d = 16, 2, 12
    qkv = torch.randn(9, 3 * hkv * d)
    k = qkv[:, hkv * d : 2 * hkv * d].view(9, hkv, d)
    v = qkv[:, 2 * hkv * d :].view(9, hkv, d)
    slots = torch.tensor([3, 4, 5, PAD_SLOT_ID, 40, 41, 17, 63, PAD_SLOT_ID])
    caches = [make_cache(4, block_size, hkv, d, torch.float32) for _ in range(2)]
    reshape_and_cache(k, v, *caches[0], slots, backend="torch")
    reshape_and_cache(k, v, *caches[1], slots, backend="triton")
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_reshape_and_cache_takes_strided_heads_and_caches(backend):
    # k as a slice of a wider tensor and a v cache with strided slots (written through a copy by the
    # Triton wrapper): the same writes as contiguous tensors.
    k = torch.randn(3, 2, 16)[:, :, ::2]
    k_cache, v_cache = make_cache(2, 4, 2, 8, torch.float32)
    v_strided = torch.full((2, 4, 2, 16), -HUGE)[..., ::2]
    slots = torch.tensor([0, PAD_SLOT_ID, 6], dtype=torch.int32)
    reshape_and_cache(k.contiguous(), k.contiguous(), k_cache, v_cache, slots.long(), backend="torch")
    reshape_and_cache(k, k, k_cache.clone(), v_strided, slots, backend=backend)
    assert torch.equal(v_strided, v_cache)
