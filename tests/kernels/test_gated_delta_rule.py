"""Gated delta rule: Triton kernels against the torch references, and the pool / padding contract.

Pools are filled with a huge sentinel; every slot a call must not touch is checked bitwise
afterwards. Triton runs under its interpreter on CPU, so the cases are small.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels._testing import assert_close
from kernels.constants import PAD_SLOT_ID
from kernels.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from tests.kernels.conftest import requires_triton
from tests.kernels.slot_contract import (
    HUGE,
    assert_batch_invariant,
    assert_row_alone_matches_batch,
    assert_same_run,
    assert_untouched,
    cu_seqlens_for,
    index_table,
    make_pool,
    row_tokens,
    rows_of,
    split_rows,
)

RECURRENT_RATIO = 2e-3
CHUNK_RATIO = 5e-3
BACKENDS = ["torch", pytest.param("triton", marks=requires_triton)]


def make_inputs(lens, hk, hv, dk, dv, dtype=torch.float32, extra_tokens=0):
    """q, k, v, g, beta for rows of the given lengths, plus cu_seqlens (int32)."""
    t = sum(lens) + extra_tokens
    q = torch.randn(t, hk, dk, dtype=dtype)
    k = torch.randn(t, hk, dk, dtype=dtype)
    v = torch.randn(t, hv, dv, dtype=dtype)
    g = F.logsigmoid(torch.randn(t, hv) + 2.0)          # log decay in (-inf, 0), mostly near 0
    beta = torch.rand(t, hv)
    cu = cu_seqlens_for(lens)
    return q, k, v, g, beta, cu


def recurrent(*args, backend, **kw):
    return fused_recurrent_gated_delta_rule(*args, backend=backend, **kw)


def chunk(*args, backend, **kw):
    return chunk_gated_delta_rule(*args, backend=backend, **kw)


# ---------------------------------------------------------------- Triton against the reference

RECURRENT_CASES = [
    # lens, Hk, Hv, Dk, Dv
    ([1], 1, 1, 16, 16),
    ([2, 0, 5], 2, 2, 12, 20),
    ([17, 1], 1, 2, 20, 12),
    ([63, 0, 2], 2, 2, 16, 12),
    ([65], 1, 2, 12, 16),
    ([3, 4], 1, 1, 16, 40),            # two value blocks, the second one partial
]


@requires_triton
@pytest.mark.parametrize("lens,hk,hv,dk,dv", [pytest.param(*c, id="L{}-Hk{}-Hv{}-Dk{}-Dv{}".format(*c))
                                              for c in RECURRENT_CASES])
def test_recurrent_triton_matches_reference(lens, hk, hv, dk, dv):
    q, k, v, g, beta, cu = make_inputs(lens, hk, hv, dk, dv, extra_tokens=2)
    n = len(lens)
    idx = torch.randperm(2 * n + 1)[:n].to(torch.int32)
    has_init = torch.rand(n) > 0.3
    pool = make_pool(2 * n + 1, (hv, dk, dv), idx.tolist())
    pools = {b: pool.clone() for b in ("torch", "triton")}
    outs = {b: recurrent(q, k, v, g, beta, pools[b], cu, idx, has_initial_state=has_init, backend=b)
            for b in pools}
    assert_close("o", outs["torch"], outs["triton"], RECURRENT_RATIO)
    assert_close("ht", pools["torch"][idx.long()], pools["triton"][idx.long()], RECURRENT_RATIO)
    assert torch.equal(outs["triton"][sum(lens):], torch.zeros_like(outs["triton"][sum(lens):]))
    for after in pools.values():
        assert_untouched(pool, after, [s for s, n_ in zip(idx.tolist(), lens) if n_ > 0])


SPEC_CASES = [([1, 3, 4, 0, 2], 3, 1, 2, 16, 12), ([2, 2], 1, 2, 2, 20, 16)]


@requires_triton
@pytest.mark.parametrize("lens,k_spec,hk,hv,dk,dv",
                         [pytest.param(*c, id="L{}-K{}-Hk{}-Hv{}-Dk{}-Dv{}".format(*c)) for c in SPEC_CASES])
def test_recurrent_spec_triton_matches_reference(lens, k_spec, hk, hv, dk, dv):
    q, k, v, g, beta, cu = make_inputs(lens, hk, hv, dk, dv)
    n = len(lens)
    idx = torch.randperm(n * (k_spec + 1) + 3)[: n * (k_spec + 1)].view(n, k_spec + 1).to(torch.int32)
    idx[n // 2, 0] = PAD_SLOT_ID                                   # a padding row
    accepted = torch.randint(1, k_spec + 2, (n,), dtype=torch.int32)
    pool = make_pool(n * (k_spec + 1) + 3, (hv, dk, dv), idx[idx >= 0].tolist())
    pools = {b: pool.clone() for b in ("torch", "triton")}
    outs = {b: recurrent(q, k, v, g, beta, pools[b], cu, idx, num_valid=accepted, backend=b)
            for b in pools}
    assert_close("o", outs["torch"], outs["triton"], RECURRENT_RATIO)
    assert_close("states", pools["torch"][idx[idx >= 0].long()], pools["triton"][idx[idx >= 0].long()],
                 RECURRENT_RATIO)
    pad_tokens = row_tokens(cu, n // 2)
    assert torch.equal(outs["triton"][pad_tokens], torch.zeros_like(outs["triton"][pad_tokens]))
    written = [int(idx[i, t]) for i in range(n) if i != n // 2 for t in range(lens[i])]
    for after in pools.values():
        assert_untouched(pool, after, written)


CHUNK_CASES = [
    # lens, Hk, Hv, Dk, Dv, chunk_size; the cases marked slow repeat what the default ones and the
    # per-phase tests (test_gated_delta_rule_phases.py) check, at more shapes
    ([1, 0, 2], 1, 1, 16, 12, 16),
    ([17], 2, 2, 12, 20, 16, "slow"),
    ([63, 5], 1, 2, 20, 16, 64, "slow"),
    ([65], 2, 4, 16, 16, 64),          # the Dk = 16 / chunk 64 shape of the H100 run (its README)
    ([20], 1, 1, 12, 40, 16, "slow"),  # two value blocks, the second one partial
    ([9, 1], 1, 2, 80, 20, 16),       # Dk over two key tiles, the second one partial; T = 1 row
    ([18], 1, 1, 200, 16, 16, "slow"),  # Dk over four key tiles (the most the state kernel keeps)
    ([40, 33], 1, 2, 16, 16, 32),     # two 16-token blocks per chunk in the triangular solve
]


@requires_triton
@pytest.mark.parametrize("lens,hk,hv,dk,dv,bt",
                         [pytest.param(*c[:6], id="L{}-Hk{}-Hv{}-Dk{}-Dv{}-BT{}".format(*c),
                                       marks=[pytest.mark.slow] if c[6:] == ("slow",) else [])
                          for c in CHUNK_CASES])
def test_chunk_triton_matches_reference(lens, hk, hv, dk, dv, bt):
    q, k, v, g, beta, cu = make_inputs(lens, hk, hv, dk, dv, extra_tokens=1)
    n = len(lens)
    idx = torch.randperm(n + 2)[:n].to(torch.int32)
    has_init = torch.tensor([i % 2 == 0 for i in range(n)])
    pool = make_pool(n + 2, (hv, dk, dv), idx.tolist())
    pools = {b: pool.clone() for b in ("torch", "triton")}
    outs = {b: chunk(q, k, v, g, beta, pools[b], cu, idx, has_init, chunk_size=bt, backend=b) for b in pools}
    assert_close("o", outs["torch"], outs["triton"], CHUNK_RATIO)
    assert_close("ht", pools["torch"][idx.long()], pools["triton"][idx.long()], CHUNK_RATIO)
    # The chunked kernel agrees with the recurrent reference as well.
    ref_pool = pool.clone()
    ref = recurrent(q, k, v, g, beta, ref_pool, cu, idx, has_initial_state=has_init, backend="torch")
    assert_close("o vs recurrent", ref, outs["triton"], CHUNK_RATIO)
    assert_close("ht vs recurrent", ref_pool[idx.long()], pools["triton"][idx.long()], CHUNK_RATIO)
    for after in pools.values():
        assert_untouched(pool, after, [s for s, n_ in zip(idx.tolist(), lens) if n_ > 0])


@requires_triton
@pytest.mark.parametrize("bt", [16, 64])
def test_chunk_triton_with_correlated_keys(bt):
    """Near-identical keys, beta near 1, little decay: A is large, so every part of the triangular solve
    counts."""
    lens, hv, dk, dv = [70, 9], 2, 16, 12
    q, _, v, _, _, cu = make_inputs(lens, 1, hv, dk, dv)
    t = q.shape[0]
    k = torch.randn(1, 1, dk) + 0.05 * torch.randn(t, 1, dk)
    g = torch.full((t, hv), -0.01)
    beta = 0.9 + 0.1 * torch.rand(t, hv)
    idx = torch.tensor([1, 0], dtype=torch.int32)
    has_init = torch.tensor([True, False])
    pool = make_pool(2, (hv, dk, dv), [0, 1])
    p_ref, p_tri = pool.clone(), pool.clone()
    ref = recurrent(q, k, v, g, beta, p_ref, cu, idx, has_initial_state=has_init, backend="torch")
    out = chunk(q, k, v, g, beta, p_tri, cu, idx, has_init, chunk_size=bt, backend="triton")
    assert_close("o", ref, out, CHUNK_RATIO)
    assert_close("ht", p_ref, p_tri, CHUNK_RATIO)


# ------------------------------------------------------------- contract tests on both backends

@pytest.mark.parametrize("lens,bt", [([40, 70], 64), ([20], 16)])
def test_chunk_reference_matches_recurrent(lens, bt):
    q, k, v, g, beta, cu = make_inputs(lens, 2, 4, 16, 12)
    idx = torch.arange(len(lens), dtype=torch.int32)
    has_init = torch.ones(len(lens), dtype=torch.bool)
    pool = make_pool(len(lens), (4, 16, 12), idx.tolist())
    p_rec, p_chunk = pool.clone(), pool.clone()
    o_rec = recurrent(q, k, v, g, beta, p_rec, cu, idx, has_initial_state=has_init, backend="torch")
    o_chunk = chunk(q, k, v, g, beta, p_chunk, cu, idx, has_init, chunk_size=bt, backend="torch")
    assert_close("o", o_rec, o_chunk, CHUNK_RATIO)
    assert_close("ht", p_rec, p_chunk, CHUNK_RATIO)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split", [1, 7, 16])
def test_recurrent_chunking_invariance(backend, split):
    """Tokens [0:a] then [a:L] through the pool == [0:L] in one call, bitwise."""
    length = 20
    q, k, v, g, beta, cu = make_inputs([length], 1, 2, 12, 16)
    idx = torch.tensor([1], dtype=torch.int32)
    pool = make_pool(3, (2, 12, 16), [1])
    whole_pool = pool.clone()
    whole = recurrent(q, k, v, g, beta, whole_pool, cu, idx, backend=backend)
    parts = []
    for lo, hi in ((0, split), (split, length)):
        part_cu = torch.tensor([0, hi - lo], dtype=torch.int32)
        parts.append(recurrent(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], pool, part_cu, idx,
                               backend=backend))
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(pool, whole_pool)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["recurrent", "chunk"])
def test_has_initial_state_false_ignores_dirty_slot(backend, op):
    q, k, v, g, beta, cu = make_inputs([5], 1, 2, 16, 12)
    idx = torch.tensor([0], dtype=torch.int32)
    no_init = torch.tensor([False])
    dirty = torch.randn(1, 2, 16, 12) * 1e3
    dirty[0, 0, 0, 0] = float("nan")
    clean = torch.zeros(1, 2, 16, 12)
    if op == "recurrent":
        o_dirty = recurrent(q, k, v, g, beta, dirty, cu, idx, has_initial_state=no_init, backend=backend)
        o_clean = recurrent(q, k, v, g, beta, clean, cu, idx, backend=backend)
    else:
        o_dirty = chunk(q, k, v, g, beta, dirty, cu, idx, no_init, chunk_size=16, backend=backend)
        o_clean = chunk(q, k, v, g, beta, clean, cu, idx, torch.tensor([True]), chunk_size=16,
                        backend=backend)
    assert torch.equal(o_dirty, o_clean)
    assert torch.equal(dirty, clean)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["recurrent", "spec", "chunk"])
def test_batch_invariance(backend, op):
    """A row's output and state are bitwise the same alone and among neighbours and padding."""
    hk, hv, dk, dv, k_spec = 1, 2, 12, 16, 3
    lens = [3, 4, 0, 2] if op == "spec" else [9, 4, 0, 7]
    q, k, v, g, beta, cu = make_inputs(lens, hk, hv, dk, dv, extra_tokens=3)
    n, target = len(lens), 1
    cols = k_spec + 1 if op == "spec" else 1
    idx = index_table(torch.arange(n * cols), n, op == "spec", pad_rows=[2])
    accepted = torch.tensor([2, 3, 1, 4], dtype=torch.int32) if op == "spec" else None
    has_init = torch.tensor([True, True, False, False])
    pool = make_pool(n * cols, (hv, dk, dv), range(n * cols))

    def run(p, sl, i, a, h):
        tok, c = rows_of(cu, sl)
        args = (q[tok], k[tok], v[tok], g[tok], beta[tok], p, c, i)
        if op == "chunk":
            return chunk(*args, h, chunk_size=16, backend=backend)
        kw = {"num_valid": a} if op == "spec" else {}
        return recurrent(*args, has_initial_state=h, backend=backend, **kw)

    assert_batch_invariant(run, cu, target, pool, idx, accepted, has_init)


@pytest.mark.parametrize("backend", BACKENDS)
def test_spec_continuation_matches_fresh_run(backend):
    """For each accepted count a, continuing from column a-1 equals a plain run over the accepted
    prefix followed by the next step's tokens."""
    hk, hv, dk, dv, k_spec = 1, 2, 16, 12, 3
    q, k, v, g, beta, _ = make_inputs([2 * (k_spec + 1)], hk, hv, dk, dv)
    draft, nxt = slice(0, k_spec + 1), slice(k_spec + 1, 2 * (k_spec + 1))
    base = make_pool(2 * (k_spec + 1), (hv, dk, dv), [0])
    cu = torch.tensor([0, k_spec + 1], dtype=torch.int32)
    cols = torch.arange(k_spec + 1, dtype=torch.int32).view(1, -1)    # slot of column j: j
    for a in range(1, k_spec + 2):
        pool = base.clone()
        # Step 1 verifies K+1 tokens from slot 0; step 2 keeps the first a of them.
        recurrent(q[draft], k[draft], v[draft], g[draft], beta[draft], pool, cu, cols,
                  num_valid=torch.tensor([1], dtype=torch.int32), backend=backend)
        o_cont = recurrent(q[nxt], k[nxt], v[nxt], g[nxt], beta[nxt], pool, cu, cols,
                           num_valid=torch.tensor([a], dtype=torch.int32), backend=backend)
        fresh_pool = base.clone()
        tok = torch.cat([torch.arange(a), torch.arange(k_spec + 1, 2 * (k_spec + 1))])
        fresh_cu = torch.tensor([0, a + k_spec + 1], dtype=torch.int32)
        o_fresh = recurrent(q[tok], k[tok], v[tok], g[tok], beta[tok], fresh_pool, fresh_cu,
                            torch.tensor([0], dtype=torch.int32), backend=backend)
        assert_same_run(backend, f"o a={a}", o_fresh[a:], o_cont, RECURRENT_RATIO)
        assert_same_run(backend, f"ht a={a}", fresh_pool[0], pool[int(cols[0, -1])], RECURRENT_RATIO)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_prefix_then_recurrent_matches_one_chunk_pass(backend):
    lens, split = [40, 21], [35, 18]
    q, k, v, g, beta, cu = make_inputs(lens, 2, 2, 16, 12)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    has_init = torch.tensor([False, True])
    pool = make_pool(3, (2, 16, 12), [0, 2])
    whole_pool = pool.clone()
    o_whole = chunk(q, k, v, g, beta, whole_pool, cu, idx, has_init, chunk_size=16, backend=backend)
    head, head_cu, tail, tail_cu = split_rows(cu, split)
    chunk(q[head], k[head], v[head], g[head], beta[head], pool, head_cu, idx, has_init, chunk_size=16,
          backend=backend)
    o_tail = recurrent(q[tail], k[tail], v[tail], g[tail], beta[tail], pool, tail_cu, idx, backend=backend)
    assert_close("o tail", o_whole[tail], o_tail, CHUNK_RATIO)
    assert_close("ht", whole_pool, pool, CHUNK_RATIO)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pad_rows_read_and_write_nothing(backend):
    q, k, v, g, beta, cu = make_inputs([3, 2], 1, 1, 12, 12)
    pool = torch.full((2, 1, 12, 12), HUGE)
    idx = torch.full((2,), PAD_SLOT_ID, dtype=torch.int32)
    before = pool.clone()
    o = recurrent(q, k, v, g, beta, pool, cu, idx, backend=backend)
    o_chunk = chunk(q, k, v, g, beta, pool, cu, idx, torch.ones(2, dtype=torch.bool), chunk_size=16,
                    backend=backend)
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(o_chunk, torch.zeros_like(o_chunk))
    assert torch.equal(pool, before)


def test_bfloat16_inputs_keep_dtype():
    q, k, v, g, beta, cu = make_inputs([4], 1, 1, 16, 16, dtype=torch.bfloat16)
    pool = torch.zeros(1, 1, 16, 16)
    o = recurrent(q, k, v, g, beta, pool, cu, torch.zeros(1, dtype=torch.int32), backend="torch")
    assert o.dtype == torch.bfloat16 and pool.dtype == torch.float32


@pytest.mark.cpu_only
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_reference_batch_invariance_large_batch(spec):
    """Enough rows that torch's CPU reductions are split across threads: still bitwise the same."""
    rows, hk, hv, d, k_spec, target = 48, 2, 4, 32, 3, 5
    lens = torch.randint(0 if not spec else 1, k_spec + 2, (rows,)).tolist()
    lens[target] = k_spec + 1
    q, k, v, g, beta, cu = make_inputs(lens, hk, hv, d, d)
    cols = k_spec + 1 if spec else 1
    idx = index_table(torch.randperm(rows * cols), rows, spec, pad_rows=slice(None, None, 7))  # not target 5
    accepted = torch.randint(1, k_spec + 2, (rows,), dtype=torch.int32) if spec else None
    pool = make_pool(rows * cols, (hv, d, d), range(rows * cols))
    batch_pool, alone_pool = pool.clone(), pool.clone()
    o_batch = recurrent(q, k, v, g, beta, batch_pool, cu, idx, num_valid=accepted, backend="torch")
    one = slice(target, target + 1)
    tok, one_cu = rows_of(cu, one)
    o_alone = recurrent(q[tok], k[tok], v[tok], g[tok], beta[tok], alone_pool, one_cu, idx[one],
                        num_valid=None if accepted is None else accepted[one], backend="torch")
    assert_row_alone_matches_batch(cu, target, idx, o_batch, o_alone, batch_pool, alone_pool)


SWEEP = [  # lens, Hk, Hv, Dk, Dv
    ([128, 1, 77], 2, 4, 32, 48),
    ([200], 1, 4, 64, 64),
    ([65, 64, 63], 4, 4, 48, 32),
]


@requires_triton
@pytest.mark.slow
@pytest.mark.parametrize("lens,hk,hv,dk,dv", [pytest.param(*c, id="L{}-Hk{}-Hv{}-Dk{}-Dv{}".format(*c))
                                              for c in SWEEP])
def test_sweep_triton_matches_reference(lens, hk, hv, dk, dv):
    q, k, v, g, beta, cu = make_inputs(lens, hk, hv, dk, dv)
    n = len(lens)
    idx = torch.arange(n, dtype=torch.int32)
    has_init = torch.ones(n, dtype=torch.bool)
    pool = make_pool(n, (hv, dk, dv), range(n))
    pools = {name: pool.clone() for name in ("ref", "rec", "chunk")}
    ref = recurrent(q, k, v, g, beta, pools["ref"], cu, idx, has_initial_state=has_init, backend="torch")
    rec = recurrent(q, k, v, g, beta, pools["rec"], cu, idx, has_initial_state=has_init, backend="triton")
    out = chunk(q, k, v, g, beta, pools["chunk"], cu, idx, has_init, backend="triton")
    assert_close("recurrent o", ref, rec, RECURRENT_RATIO)
    assert_close("recurrent ht", pools["ref"], pools["rec"], RECURRENT_RATIO)
    assert_close("chunk o", ref, out, CHUNK_RATIO)
    assert_close("chunk ht", pools["ref"], pools["chunk"], CHUNK_RATIO)
