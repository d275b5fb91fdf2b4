"""Benchmarks of linear (Triton against the torch reference), on a CUDA device only.

Run: ``pytest tests/kernels/bench/test_bench_linear.py --benchmark-only -p no:xdist`` (the ``gpu``
mark makes them skip without CUDA). The tiny test model's projections and a Qwen3-Next-sized one
(hidden 2048), in bfloat16, plus plain ``torch.matmul`` as the floor.
"""

from __future__ import annotations

import pytest
import torch

from kernels.linear import linear

pytestmark = pytest.mark.gpu

SHAPES = {  # (M, K, N)
    "tiny-256x128x512": (256, 128, 512),
    "decode-64x2048x2048": (64, 2048, 2048),
    "prefill-2048x2048x4096": (2048, 2048, 4096),
}



@pytest.mark.parametrize("impl", ["triton", "torch", "matmul"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bench_linear(cuda_benchmark, impl, shape):
    m, k, n = SHAPES[shape]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if impl == "matmul":
        cuda_benchmark(lambda: x @ w.t())
    else:
        cuda_benchmark(lambda: linear(x, w, backend=impl))
