"""Benchmarks of the GDN kernels (Triton against the torch reference), on a CUDA device only.

Run: ``pytest tests/kernels/bench/test_bench_gdn.py --benchmark-only`` (add ``-m gpu`` or nothing:
the ``gpu`` mark makes them skip without CUDA). Sizes follow Qwen3-Next-80B per tensor-parallel
rank 1: Hk = 16, Hv = 32, Dk = Dv = 128, conv channels 2*16*128 + 32*128, width 4.
"""

from __future__ import annotations

import pytest
import torch

from kernels.conv1d import causal_conv1d_update
from kernels.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from tests.kernels.bench.conftest import gdn_inputs

pytestmark = pytest.mark.gpu

HK, HV, D, WIDTH = 16, 32, 128, 4
CONV_DIM = 2 * HK * D + HV * D



@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("rows,spec_tokens", [(64, 0), (16, 3)])
def test_bench_recurrent(cuda_benchmark, backend, rows, spec_tokens):
    q, k, v, g, beta, cu = gdn_inputs([spec_tokens + 1] * rows, HK, HV, D)
    pool = torch.zeros(rows * (spec_tokens + 1) + 1, HV, D, D, device="cuda")
    if spec_tokens:
        idx = torch.arange(rows * (spec_tokens + 1), dtype=torch.int32, device="cuda").view(rows, -1)
        accepted = torch.randint(1, spec_tokens + 2, (rows,), dtype=torch.int32, device="cuda")
    else:
        idx, accepted = torch.arange(rows, dtype=torch.int32, device="cuda"), None
    cuda_benchmark(lambda: fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, pool, cu, idx, num_valid=accepted, backend=backend))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("lens", [[2048], [512, 1000, 300, 10]], ids=["one-2048", "varlen-4"])
def test_bench_chunk(cuda_benchmark, backend, lens):
    q, k, v, g, beta, cu = gdn_inputs(lens, HK, HV, D)
    pool = torch.zeros(len(lens), HV, D, D, device="cuda")
    idx = torch.arange(len(lens), dtype=torch.int32, device="cuda")
    has_init = torch.zeros(len(lens), dtype=torch.bool, device="cuda")
    cuda_benchmark(lambda: chunk_gated_delta_rule(q, k, v, g, beta, pool, cu, idx, has_init,
                                                     backend=backend))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bench_conv_update(cuda_benchmark, backend):
    rows, spec_tokens = 32, 3
    x = torch.randn(rows * (spec_tokens + 1), CONV_DIM, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(CONV_DIM, WIDTH, device="cuda", dtype=torch.bfloat16)
    state = torch.zeros(rows, CONV_DIM, WIDTH - 1 + spec_tokens, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, rows * (spec_tokens + 1) + 1, spec_tokens + 1, dtype=torch.int32, device="cuda")
    idx = torch.arange(rows, dtype=torch.int32, device="cuda")
    accepted = torch.randint(1, spec_tokens + 2, (rows,), dtype=torch.int32, device="cuda")
    cuda_benchmark(lambda: causal_conv1d_update(x, weight, state, cu, idx, num_valid=accepted,
                                                   backend=backend))


@pytest.mark.parametrize("phase", ["cumsum", "solve", "wy", "state", "output"])
def test_bench_chunk_phase(cuda_benchmark, phase):
    """Each of the chunked form's five launches alone, on one 4096-token row (bf16 inputs), its inputs
    made by the phases before it outside the timed region: where the chunked prefill's time goes."""
    from kernels.gated_delta_rule import triton_chunk as tc

    q, k, v, g, beta, cu = gdn_inputs([4096], HK, HV, D)
    t, bt, dev = q.shape[0], 64, "cuda"
    pool = torch.zeros(1, HV, D, D, device=dev)
    idx = torch.zeros(1, dtype=torch.int32, device=dev)
    has_init = torch.zeros(1, dtype=torch.bool, device=dev)
    gc, rk = (torch.empty(t, HV, device=dev) for _ in range(2))
    a_inv = torch.empty(t, HV, bt, device=dev)
    w, u = torch.empty(t, HV, D, device=dev), torch.empty(t, HV, D, device=dev)
    h = torch.empty(t // bt + 1, HV, D, D, device=dev)
    o = torch.zeros(t, HV, D, device=dev, dtype=v.dtype)
    lowp = tc.lowp_products(q, k)
    launches = {
        "cumsum": lambda: tc.launch_cumsum(g, cu, bt, gc),
        "solve": lambda: tc.launch_solve(k, beta, gc, cu, bt, True, lowp, a_inv, rk),
        "wy": lambda: tc.launch_wy(k, v, beta, gc, a_inv, rk, cu, bt, w, u),
        "state": lambda: tc.launch_state(k, w, u.clone(), gc, rk, pool, cu, idx, has_init, bt, h),
        "output": lambda: tc.launch_output(q, k, u, gc, h, cu, idx, bt, D ** -0.5, True, lowp, o),
    }
    for name in list(launches)[: list(launches).index(phase)]:
        launches[name]()
    cuda_benchmark(launches[phase])
