"""Shared fixture for the GPU kernel benchmarks."""

from __future__ import annotations

import pytest
import torch


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
