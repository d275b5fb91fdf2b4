"""The GDN kernels against flash-linear-attention's, at Qwen3-Next-80B sizes per rank (CUDA only).

Run: ``pip install -e ".[bench]"`` then ``pytest tests/kernels/bench/test_bench_fla.py -p no:xdist -s``
(also under ``--benchmark-only``, where the table shows our time and ``extra_info`` both).
Skipped without CUDA or without flash-linear-attention (the ``bench`` extra installs its ``fla-core``
kernels). Each case prints both times (median of ``triton.testing.do_bench``) and ours / fla: at or
under 1.0 meets the bar in DESIGN.md §7. fla gets q and k already expanded to the value heads (its
kernels take one head count), outside the timed region.
"""

from __future__ import annotations

import pytest
import torch

from kernels.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from tests.kernels.bench.conftest import gdn_inputs

pytestmark = pytest.mark.gpu

HK, HV, D = 16, 32, 128


def _for_fla(q, k, v, g, beta):
    """fla's layout: a batch of one, [1, T, H, D], q and k repeated to the value heads."""
    rep = HV // HK
    return (q.repeat_interleave(rep, 1)[None], k.repeat_interleave(rep, 1)[None], v[None], g[None],
            beta.to(v.dtype)[None])


def _compare(name, ours_fn, fla_fn, benchmark):
    """Time both the same way (do_bench, CUDA events), print the ratio, and put ours in the benchmark
    table."""
    from triton.testing import do_bench

    ours_ms = do_bench(ours_fn, return_mode="median")
    fla_ms = do_bench(fla_fn, return_mode="median")
    ratio = ours_ms / fla_ms
    print(f"\n{name}: ours {ours_ms:.3f} ms, fla {fla_ms:.3f} ms, ours/fla {ratio:.2f}")
    benchmark.extra_info.update({"ours_ms": ours_ms, "fla_ms": fla_ms, "ours_over_fla": ratio})

    def ours_synced():
        ours_fn()
        torch.cuda.synchronize()

    benchmark.pedantic(ours_synced, rounds=20, warmup_rounds=2)


@pytest.mark.parametrize("lens", [[4096], [2048, 1000, 700, 300, 40, 8]], ids=["one-4096", "varlen-6"])
def test_chunk_prefill_vs_fla(lens, benchmark):
    fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule")

    q, k, v, g, beta, cu = gdn_inputs(lens, HK, HV, D)
    n = len(lens)
    pool = torch.zeros(n, HV, D, D, device="cuda")
    idx = torch.arange(n, dtype=torch.int32, device="cuda")
    has_init = torch.zeros(n, dtype=torch.bool, device="cuda")
    fq, fk, fv, fg, fb = _for_fla(q, k, v, g, beta)
    cu_long = cu.long()
    _compare(
        f"chunk prefill {lens}",
        lambda: chunk_gated_delta_rule(q, k, v, g, beta, pool, cu, idx, has_init),
        lambda: fla_gdn.chunk_gated_delta_rule(
            fq, fk, fv, fg, fb, output_final_state=True, cu_seqlens=cu_long, use_qk_l2norm_in_kernel=True
        ),
        benchmark,
    )


@pytest.mark.parametrize("rows,tokens", [(64, 4), (64, 1)], ids=["verify-64x4", "decode-64"])
def test_recurrent_vs_fla(rows, tokens, benchmark):
    fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule")

    q, k, v, g, beta, cu = gdn_inputs([tokens] * rows, HK, HV, D)
    pool = torch.randn(rows * tokens, HV, D, D, device="cuda") * 0.1
    if tokens > 1:
        idx = torch.arange(rows * tokens, dtype=torch.int32, device="cuda").view(rows, tokens)
        accepted = torch.ones(rows, dtype=torch.int32, device="cuda")
    else:
        idx, accepted = torch.arange(rows, dtype=torch.int32, device="cuda"), None
    fq, fk, fv, fg, fb = _for_fla(q, k, v, g, beta)
    h0 = pool[:rows].clone()
    cu_long = cu.long()
    _compare(
        f"recurrent {rows} rows x {tokens} tokens",
        lambda: fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, pool, cu, idx, num_valid=accepted
        ),
        lambda: fla_gdn.fused_recurrent_gated_delta_rule(
            fq,
            fk,
            fv,
            fg,
            fb,
            initial_state=h0,
            output_final_state=True,
            cu_seqlens=cu_long,
            use_qk_l2norm_in_kernel=True,
        ),
        benchmark,
    )
