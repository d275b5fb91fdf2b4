"""Benchmarks of paged_attention (Triton against the torch reference), on a CUDA device only.

Run: ``pytest tests/kernels/bench/test_bench_attention.py --benchmark-only -p no:xdist`` (the ``gpu``
mark makes them skip without CUDA). Sizes follow Qwen3-Next full attention: Hq = 16, Hkv = 2,
D = 256, block size 16, bfloat16.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.attention import paged_attention

pytestmark = pytest.mark.gpu

HQ, HKV, D, BLOCK_SIZE = 16, 2, 256, 16


def attention_inputs(rows):
    """rows: (context length, query length) per row; blocks handed out in a shuffled order."""
    dev = "cuda"
    blocks_per_row = [math.ceil((c + q) / BLOCK_SIZE) for c, q in rows]
    num_blocks = sum(blocks_per_row)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, HKV, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=dev).int()
    table = torch.zeros(len(rows), max(blocks_per_row), dtype=torch.int32, device=dev)
    start = 0
    for i, nb in enumerate(blocks_per_row):
        table[i, :nb] = perm[start : start + nb]
        start += nb
    qlens = torch.tensor([q for _, q in rows], dtype=torch.int32)
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qsl[1:] = qlens.cumsum(0)
    seq_lens = torch.tensor([c + q for c, q in rows], dtype=torch.int32, device=dev)
    q = torch.randn(int(qsl[-1]), HQ, D, device=dev, dtype=torch.bfloat16)
    return q, k_cache, v_cache, qsl.to(dev), seq_lens, table



CASES = {
    "decode-64x1k": [(1024, 1)] * 64,
    "verify-16x1k-k3": [(1024, 4)] * 16,
    "prefill-512": [(0, 512)],
    "mixed": [(0, 256), (700, 1), (300, 4), (128, 128)] + [(512, 1)] * 12,
}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_bench_paged_attention(cuda_benchmark, backend, case):
    args = attention_inputs(CASES[case])
    cuda_benchmark(lambda: paged_attention(*args, scale=D**-0.5, backend=backend))
