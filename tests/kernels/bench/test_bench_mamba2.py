"""The Mamba2 chunked scan against flash-linear-attention's ``chunk_simple_gla``, at Nemotron-3 Nano
sizes (H 64, P 64, N 128, 8 groups, chunk 128), CUDA only.

Run: ``pip install -e ".[bench]"`` then ``pytest tests/kernels/bench/test_bench_mamba2.py -p no:xdist -s``.
Skipped without CUDA or without flash-linear-attention. The SSD recurrence is simple GLA with
``q = C``, ``k = B``, ``v = x dt``, ``g = dt A`` and scale 1 (kernels/mamba2/README.md); fla gets B and C
already expanded to the heads, ``x dt`` and ``dt A`` precomputed, all outside the timed region. Each
case checks the two outputs agree (fla has no ``D x`` term), then prints both times (median of
``triton.testing.do_bench``) and ours / fla.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels._testing import assert_close
from kernels.mamba2 import selective_state_update, ssd_chunk_scan
from tests.kernels.bench.test_bench_fla import _compare

pytestmark = pytest.mark.gpu

H, P, N, G, CHUNK = 64, 64, 128, 8, 128


def mamba_inputs(lens):
    t, dev = sum(lens), "cuda"
    x = torch.randn(t, H, P, device=dev, dtype=torch.bfloat16)
    dt = F.softplus(torch.randn(t, H, device=dev) - 2.0)
    a = -torch.exp(torch.randn(H, device=dev) * 0.5)
    b = torch.randn(t, G, N, device=dev, dtype=torch.bfloat16) * N ** -0.5
    c = torch.randn(t, G, N, device=dev, dtype=torch.bfloat16) * N ** -0.5
    d = torch.randn(H, device=dev)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    return x, dt, a, b, c, d, cu


@pytest.mark.parametrize("lens", [[4096], [2048, 1000, 700, 300, 40, 8]], ids=["one-4096", "varlen-6"])
def test_ssd_chunk_scan_vs_fla_chunk_simple_gla(lens, benchmark):
    fla_simple_gla = pytest.importorskip("fla.ops.simple_gla")
    x, dt, a, b, c, d, cu = mamba_inputs(lens)
    rows = len(lens)
    idx = torch.arange(rows, dtype=torch.int32, device="cuda")
    has_init = torch.ones(rows, dtype=torch.bool, device="cuda")
    pool = 0.1 * torch.randn(rows, H, P, N, device="cuda")
    h0 = pool.transpose(-1, -2).contiguous()                              # fla's state is [K, V] = [N, P]
    rep = H // G
    q, k = c.repeat_interleave(rep, 1)[None], b.repeat_interleave(rep, 1)[None]   # [1, T, H, N]
    v = (x.float() * dt[..., None]).to(x.dtype)[None]                      # [1, T, H, P]
    g = (dt * a)[None]                                                      # [1, T, H]
    cu_long = cu.long()

    def ours():
        return ssd_chunk_scan(x, dt, a, b, c, d, pool.clone(), cu, idx, has_init, chunk_size=CHUNK)

    def fla():
        return fla_simple_gla.chunk_simple_gla(q, k, v, g=g, scale=1.0, initial_state=h0,
                                               output_final_state=True, cu_seqlens=cu_long)

    # fla has no D x term: compare with D = 0 (subtracting D x from our bf16 output would leave the
    # rounding of the whole output, up to a bf16 step at |y| in [4, 8), against the smaller SSD part).
    y = ssd_chunk_scan(x, dt, a, b, c, torch.zeros_like(d), pool.clone(), cu, idx, has_init, chunk_size=CHUNK)
    o, _ = fla()
    assert_close("ours (D = 0) vs fla", o[0].float(), y.float(), 3e-2)
    _compare(f"ssd_chunk_scan {len(lens)} rows, {sum(lens)} tokens", ours, fla, benchmark)


def test_ssd_chunk_scan_vs_recurrent_on_gpu():
    """The compiled chunk scan agrees with the compiled recurrent kernel at the real shapes."""
    x, dt, a, b, c, d, cu = mamba_inputs([1000, 300])
    idx = torch.arange(2, dtype=torch.int32, device="cuda")
    pool = 0.1 * torch.randn(2, H, P, N, device="cuda")
    p_chunk, p_rec = pool.clone(), pool.clone()
    y_chunk = ssd_chunk_scan(x, dt, a, b, c, d, p_chunk, cu, idx, None, chunk_size=CHUNK)
    y_rec = selective_state_update(x, dt, a, b, c, d, p_rec, cu, idx)
    assert_close("y", y_rec.float(), y_chunk.float(), 2e-2)
    assert_close("state", p_rec, p_chunk, 5e-3)
