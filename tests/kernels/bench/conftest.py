"""Shared fixture for the GPU kernel benchmarks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture
def cuda_benchmark(benchmark):
    """``measure(fn)``: warm ``fn`` up (Triton compiles on the first call), then benchmark it with a
    CUDA synchronisation inside each timed round so the kernel's time is what gets measured."""

    def measure(fn):
        def run():
            fn()
            torch.cuda.synchronize()

        run()  # compile / warm up outside the measurement
        benchmark(run)

    return measure


def gdn_inputs(lens: list[int], hk: int, hv: int, d: int):
    """Random bf16 GDN inputs on CUDA for rows of ``lens`` tokens: q, k [T, Hk, D], v [T, Hv, D],
    g (log decay) and beta [T, Hv] float32, query_start_loc int32 [N+1]."""
    t, dev = sum(lens), "cuda"
    q = torch.randn(t, hk, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(t, hk, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(t, hv, d, device=dev, dtype=torch.bfloat16)
    g = F.logsigmoid(torch.randn(t, hv, device=dev) + 2.0)
    beta = torch.rand(t, hv, device=dev)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    return q, k, v, g, beta, cu
