"""Mamba2 (SSD): the recurrent and chunked ops against an independent per-token loop, Triton against the
torch references, and the pool / padding / speculative-slot contract (as for the gated delta rule).

Pools are filled with a huge sentinel; every slot a call must not touch is checked bitwise afterwards.
Triton runs under its interpreter on CPU, so the cases are small.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels._testing import assert_close
from kernels.constants import PAD_SLOT_ID
from kernels.mamba2 import selective_state_update, ssd_chunk_scan
from kernels.mamba2.naive import chunk_bounds
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
# The interpreter is slow: contract tests whose kernel paths the default tier already covers run their
# Triton half under -m slow.
BACKENDS_SLOW = ["torch", pytest.param("triton", marks=[requires_triton, pytest.mark.slow])]


def make_inputs(lens, h, p, g, n, dtype=torch.float32, extra_tokens=0):
    """x, dt, A, B, C, D for rows of the given lengths, plus cu_seqlens (int32)."""
    t = sum(lens) + extra_tokens
    x = torch.randn(t, h, p, dtype=dtype)
    dt = F.softplus(torch.randn(t, h) - 1.0)            # softplus(dt_raw + dt_bias): positive
    a = -torch.exp(torch.randn(h) * 0.5)                # -exp(A_log)
    b = torch.randn(t, g, n, dtype=dtype) * 0.5
    c = torch.randn(t, g, n, dtype=dtype) * 0.5
    d = torch.randn(h)
    cu = cu_seqlens_for(lens)
    return x, dt, a, b, c, d, cu


def recurrent(*args, backend, **kw):
    return selective_state_update(*args, backend=backend, **kw)


def chunk(*args, backend, **kw):
    return ssd_chunk_scan(*args, backend=backend, **kw)


def loop_scan(x, dt, a, b, c, d, state):
    """An independent check: one sequence, token by token, head by head, in float64.

    x [L, H, P], dt [L, H], a, d [H], b, c [L, G, N], state [H, P, N]. Returns (y [L, H, P], state)."""
    x, dt, a, b, c, d = (t.double() for t in (x, dt, a, b, c, d))
    state = state.double().clone()
    heads, groups = x.shape[1], b.shape[1]
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for h in range(heads):
            grp = h // (heads // groups)
            state[h] = torch.exp(dt[t, h] * a[h]) * state[h] + dt[t, h] * torch.outer(x[t, h], b[t, grp])
            y[t, h] = state[h] @ c[t, grp] + d[h] * x[t, h]
    return y, state


# ------------------------------------------------------------ the references against the loop

@pytest.mark.parametrize("op", ["recurrent", "chunk"])
def test_reference_matches_per_token_loop(op):
    """Rows of several lengths, a row starting mid-chunk, GQA-style groups, one row without initial state."""
    lens, h, p, g, n = [5, 0, 23, 9], 4, 6, 2, 10
    x, dt, a, b, c, d, cu = make_inputs(lens, h, p, g, n)
    idx = torch.tensor([3, 0, 1, 4], dtype=torch.int32)
    has_init = torch.tensor([True, True, False, True])
    pool = make_pool(5, (h, p, n), [1, 3, 4])
    before = pool.clone()
    kw = {"has_initial_state": has_init}
    if op == "chunk":
        y = chunk(x, dt, a, b, c, d, pool, cu, idx, has_init, chunk_size=16,
                  start_positions=torch.tensor([3, 0, 0, 30], dtype=torch.int32), backend="torch")
    else:
        y = recurrent(x, dt, a, b, c, d, pool, cu, idx, backend="torch", **kw)
    for i, length in enumerate(lens):
        if length == 0:
            continue
        tok = row_tokens(cu, i)
        init = before[idx[i]] if has_init[i] else torch.zeros(h, p, n)
        y_ref, s_ref = loop_scan(x[tok], dt[tok], a, b[tok], c[tok], d, init)
        assert_close(f"row {i} y", y_ref, y[tok], 1e-5)
        assert_close(f"row {i} state", s_ref, pool[idx[i]], 1e-5)
    assert_untouched(before, pool, [3, 1, 4])


def test_chunk_bounds_follow_absolute_positions():
    """A row starting at 14 with chunk 16: the first chunk completes [0, 16), then whole chunks."""
    assert chunk_bounds(14, 21, 16) == [(0, 2), (2, 18), (18, 21)]
    assert chunk_bounds(32, 16, 16) == [(0, 16)]
    assert chunk_bounds(0, 5, 16) == [(0, 5)]
    assert chunk_bounds(15, 1, 16) == [(0, 1)]


# ---------------------------------------------------------------- Triton against the reference

RECURRENT_CASES = [
    # lens, H, P, G, N
    pytest.param([2, 0, 5], 4, 6, 2, 10, id="L[2,0,5]-H4-P6-G2-N10"),
    pytest.param([1], 1, 4, 1, 8, id="L[1]-H1-P4-G1-N8", marks=pytest.mark.slow),
    # P over two blocks, the second one partial
    pytest.param([17, 1], 2, 20, 1, 16, id="L[17,1]-H2-P20-G1-N16", marks=pytest.mark.slow),
]


@requires_triton
@pytest.mark.parametrize("lens,h,p,g,n", RECURRENT_CASES)
def test_recurrent_triton_matches_reference(lens, h, p, g, n):
    x, dt, a, b, c, d, cu = make_inputs(lens, h, p, g, n, extra_tokens=2)
    rows = len(lens)
    idx = torch.randperm(2 * rows + 1)[:rows].to(torch.int32)
    has_init = torch.rand(rows) > 0.3
    pool = make_pool(2 * rows + 1, (h, p, n), idx.tolist())
    pools = {be: pool.clone() for be in ("torch", "triton")}
    ys = {be: recurrent(x, dt, a, b, c, d, pools[be], cu, idx, has_initial_state=has_init, backend=be)
          for be in pools}
    assert_close("y", ys["torch"], ys["triton"], RECURRENT_RATIO)
    assert_close("state", pools["torch"][idx.long()], pools["triton"][idx.long()], RECURRENT_RATIO)
    assert torch.equal(ys["triton"][sum(lens):], torch.zeros_like(ys["triton"][sum(lens):]))
    for after in pools.values():
        assert_untouched(pool, after, [s for s, m in zip(idx.tolist(), lens) if m > 0])


@requires_triton
def test_recurrent_spec_triton_matches_reference():
    lens, k_spec, h, p, g, n = [1, 3, 4, 0, 2], 3, 4, 6, 2, 10
    x, dt, a, b, c, d, cu = make_inputs(lens, h, p, g, n)
    rows = len(lens)
    num_slots = rows * (k_spec + 1)
    idx = torch.randperm(num_slots + 3)[:num_slots].view(rows, k_spec + 1).to(torch.int32)
    idx[rows // 2, 0] = PAD_SLOT_ID                                  # a padding row
    idx[0, 1] = PAD_SLOT_ID                                          # a column that is not written
    accepted = torch.tensor([1, 4, 2, 1, 3], dtype=torch.int32)
    pool = make_pool(num_slots + 3, (h, p, n), idx[idx >= 0].tolist())
    pools = {be: pool.clone() for be in ("torch", "triton")}
    ys = {be: recurrent(x, dt, a, b, c, d, pools[be], cu, idx, num_valid=accepted, backend=be)
          for be in pools}
    assert_close("y", ys["torch"], ys["triton"], RECURRENT_RATIO)
    live = idx[idx >= 0].long()
    assert_close("states", pools["torch"][live], pools["triton"][live], RECURRENT_RATIO)
    pad_tokens = row_tokens(cu, rows // 2)
    assert torch.equal(ys["triton"][pad_tokens], torch.zeros_like(ys["triton"][pad_tokens]))
    written = [int(idx[i, t]) for i in range(rows) if i != rows // 2 for t in range(lens[i])
               if idx[i, t] >= 0]
    for after in pools.values():
        assert_untouched(pool, after, written)


CHUNK_CASES = [
    # lens, start positions, H, P, G, N, chunk_size
    pytest.param([21, 3], [14, 30], 2, 6, 2, 10, 16, id="L[21,3]-p[14,30]-H2-P6-G2-N10-BT16"),
    # two query blocks of a 128-token chunk
    pytest.param([70, 9], [200, 0], 2, 8, 1, 16, 128, id="L[70,9]-p[200,0]-H2-P8-G1-N16-BT128"),
    pytest.param([1, 0, 2], [31, 0, 5], 2, 4, 1, 8, 16, id="L[1,0,2]-H2-P4-G1-N8-BT16",
                 marks=pytest.mark.slow),
    # P over two blocks of the output kernel
    pytest.param([40], [50], 2, 20, 2, 16, 32, id="L[40]-p[50]-H2-P20-G2-N16-BT32", marks=pytest.mark.slow),
]


@requires_triton
@pytest.mark.parametrize("lens,starts,h,p,g,n,bt", CHUNK_CASES)
def test_chunk_triton_matches_reference(lens, starts, h, p, g, n, bt):
    """Both backends, with the states at block boundaries of 2 * chunk_size (row 0 crosses one)."""
    x, dt, a, b, c, d, cu = make_inputs(lens, h, p, g, n, extra_tokens=1)
    rows = len(lens)
    idx = torch.randperm(rows + 2)[:rows].to(torch.int32)
    has_init = torch.tensor([i % 2 == 0 for i in range(rows)])
    start = torch.tensor(starts, dtype=torch.int32)
    blocks = torch.full((rows, 2), PAD_SLOT_ID, dtype=torch.int32)
    blocks[0, 0] = rows + 2                                         # the boundary row 0 crosses
    pool = make_pool(rows + 3, (h, p, n), idx.tolist())
    pools = {be: pool.clone() for be in ("torch", "triton")}
    ys = {be: chunk(x, dt, a, b, c, d, pools[be], cu, idx, has_init, start_positions=start, chunk_size=bt,
                    block_size=2 * bt, block_state_indices=blocks, backend=be) for be in pools}
    assert_close("y", ys["torch"], ys["triton"], CHUNK_RATIO)
    assert_close("state", pools["torch"][idx.long()], pools["triton"][idx.long()], CHUNK_RATIO)
    assert_close("block state", pools["torch"][rows + 2], pools["triton"][rows + 2], CHUNK_RATIO)
    assert pools["torch"][rows + 2].abs().max() < HUGE
    # Both agree with the recurrent reference as well.
    ref_pool = pool.clone()
    ref = recurrent(x, dt, a, b, c, d, ref_pool, cu, idx, has_initial_state=has_init, backend="torch")
    assert_close("y vs recurrent", ref, ys["triton"], CHUNK_RATIO)
    assert_close("state vs recurrent", ref_pool[idx.long()], pools["triton"][idx.long()], CHUNK_RATIO)
    for after in pools.values():
        assert_untouched(pool, after, [s for s, m in zip(idx.tolist(), lens) if m > 0] + [rows + 2])


@requires_triton
@pytest.mark.slow
def test_chunk_triton_with_bfloat16_inputs():
    lens, h, p, g, n = [37], 2, 16, 1, 16
    x, dt, a, b, c, d, cu = make_inputs(lens, h, p, g, n, dtype=torch.bfloat16)
    idx, has_init = torch.tensor([0], dtype=torch.int32), torch.tensor([True])
    pool = make_pool(1, (h, p, n), [0])
    pools = {be: pool.clone() for be in ("torch", "triton")}
    ys = {be: chunk(x, dt, a, b, c, d, pools[be], cu, idx, has_init, chunk_size=16, backend=be)
          for be in pools}
    assert ys["triton"].dtype == torch.bfloat16
    assert_close("y", ys["torch"].float(), ys["triton"].float(), 2e-2)
    assert_close("state", pools["torch"], pools["triton"], CHUNK_RATIO)


# ------------------------------------------------------------- contract tests on both backends

@pytest.mark.parametrize("backend", BACKENDS_SLOW)
def test_chunk_states_at_block_boundaries(backend):
    """With block_size, the state after every absolute multiple of it inside a row is written to the
    row's block slots in order: equal to the recurrent state after that many tokens."""
    h, p, g, n, bt, block = 2, 4, 1, 8, 16, 32
    lens, starts = [50, 10, 20], [20, 0, 28]
    x, dt, a, b, c, d, cu = make_inputs(lens, h, p, g, n)
    idx = torch.tensor([0, 1, 2], dtype=torch.int32)
    has_init = torch.tensor([True, False, True])
    blocks = torch.tensor([[3, 4, 5], [6, 7, PAD_SLOT_ID], [PAD_SLOT_ID, 8, 9]], dtype=torch.int32)
    pool = make_pool(10, (h, p, n), [0, 1, 2])
    before = pool.clone()
    chunk(x, dt, a, b, c, d, pool, cu, idx, has_init, start_positions=torch.tensor(starts, dtype=torch.int32),
          chunk_size=bt, block_size=block, block_state_indices=blocks, backend=backend)
    # Row 0 (positions 20..69) crosses 32 and 64: slots 3 and 4; row 1 (0..9) none; row 2 (28..47)
    # crosses 32 whose slot is PAD: nothing. Each equals the recurrent state after that prefix.
    for slot, row, upto in ((3, 0, 32 - 20), (4, 0, 64 - 20)):
        ref_pool = before.clone()
        tok = slice(int(cu[row]), int(cu[row]) + upto)
        recurrent(x[tok], dt[tok], a, b[tok], c[tok], d, ref_pool, torch.tensor([0, upto], dtype=torch.int32),
                  idx[row:row + 1], backend="torch")
        assert_close(f"block state slot {slot}", ref_pool[idx[row]], pool[slot], CHUNK_RATIO)
    assert_untouched(before, pool, [0, 1, 2, 3, 4])


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_split_at_chunk_multiples_is_bitwise(backend):
    """A prefill cut at an absolute multiple of chunk_size, the second part starting there, runs exactly
    the chunks of the uncut one: output and state bitwise equal. Cut elsewhere it agrees within tolerance.
    The row starts at position 5 (a prefix already in the state), so chunks counted from the row's
    first token would not line up with the cut at 32."""
    h, p, g, n, bt, length, first = 2, 4, 1, 8, 16, 45, 5
    x, dt, a, b, c, d, cu = make_inputs([length], h, p, g, n)
    idx = torch.tensor([1], dtype=torch.int32)
    pool = make_pool(2, (h, p, n), [1])
    whole_pool = pool.clone()
    whole = chunk(x, dt, a, b, c, d, whole_pool, cu, idx, None, chunk_size=bt,
                  start_positions=torch.tensor([first], dtype=torch.int32), backend=backend)
    for cut, exact in ((32 - first, True), (16, False)):
        part_pool = pool.clone()
        parts = []
        for lo, hi in ((0, cut), (cut, length)):
            parts.append(chunk(x[lo:hi], dt[lo:hi], a, b[lo:hi], c[lo:hi], d, part_pool,
                               torch.tensor([0, hi - lo], dtype=torch.int32), idx, None,
                               start_positions=torch.tensor([first + lo], dtype=torch.int32), chunk_size=bt,
                               backend=backend))
        if exact:
            assert torch.equal(torch.cat(parts), whole)
            assert torch.equal(part_pool, whole_pool)
        else:
            assert_close(f"y cut {cut}", whole, torch.cat(parts), CHUNK_RATIO)
            assert_close(f"state cut {cut}", whole_pool, part_pool, CHUNK_RATIO)


@pytest.mark.parametrize("backend", BACKENDS_SLOW)
@pytest.mark.parametrize("split", [1, 7])
def test_recurrent_chunking_invariance(backend, split):
    """Tokens [0:a] then [a:L] through the pool == [0:L] in one call, bitwise."""
    length = 12
    x, dt, a, b, c, d, cu = make_inputs([length], 2, 4, 1, 8)
    idx = torch.tensor([1], dtype=torch.int32)
    pool = make_pool(3, (2, 4, 8), [1])
    whole_pool = pool.clone()
    whole = recurrent(x, dt, a, b, c, d, whole_pool, cu, idx, backend=backend)
    parts = []
    for lo, hi in ((0, split), (split, length)):
        parts.append(recurrent(x[lo:hi], dt[lo:hi], a, b[lo:hi], c[lo:hi], d, pool,
                               torch.tensor([0, hi - lo], dtype=torch.int32), idx, backend=backend))
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(pool, whole_pool)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["recurrent", "chunk"])
def test_has_initial_state_false_ignores_dirty_slot(backend, op):
    x, dt, a, b, c, d, cu = make_inputs([5], 2, 4, 1, 8)
    idx = torch.tensor([0], dtype=torch.int32)
    no_init = torch.tensor([False])
    dirty = torch.randn(1, 2, 4, 8) * 1e3
    dirty[0, 0, 0, 0] = float("nan")
    clean = torch.zeros(1, 2, 4, 8)
    if op == "recurrent":
        y_dirty = recurrent(x, dt, a, b, c, d, dirty, cu, idx, has_initial_state=no_init, backend=backend)
        y_clean = recurrent(x, dt, a, b, c, d, clean, cu, idx, backend=backend)
    else:
        y_dirty = chunk(x, dt, a, b, c, d, dirty, cu, idx, no_init, chunk_size=16, backend=backend)
        y_clean = chunk(x, dt, a, b, c, d, clean, cu, idx, torch.tensor([True]), chunk_size=16,
                        backend=backend)
    assert torch.equal(y_dirty, y_clean)
    assert torch.equal(dirty, clean)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["spec", "chunk", pytest.param("recurrent", marks=pytest.mark.slow)])
def test_batch_invariance(backend, op):
    """A row's output and state are bitwise the same alone and among neighbours and padding."""
    h, p, g, n, k_spec = 2, 4, 1, 8, 3
    lens = [3, 4, 0, 2] if op == "spec" else [9, 4, 0, 7]
    x, dt, a, b, c, d, cu = make_inputs(lens, h, p, g, n, extra_tokens=3)
    rows, target = len(lens), 1
    cols = k_spec + 1 if op == "spec" else 1
    idx = index_table(torch.arange(rows * cols), rows, op == "spec", pad_rows=[2])
    accepted = torch.tensor([2, 3, 1, 4], dtype=torch.int32) if op == "spec" else None
    has_init = torch.tensor([True, True, False, False])
    starts = torch.tensor([5, 13, 0, 2], dtype=torch.int32)
    pool = make_pool(rows * cols, (h, p, n), range(rows * cols))

    def run(pl, sl, i, acc, hi):
        tok, cuts = rows_of(cu, sl)
        args = (x[tok], dt[tok], a, b[tok], c[tok], d, pl, cuts, i)
        if op == "chunk":
            return chunk(*args, hi, start_positions=starts[sl], chunk_size=16, backend=backend)
        kw = {"num_valid": acc} if op == "spec" else {}
        return recurrent(*args, has_initial_state=hi, backend=backend, **kw)

    assert_batch_invariant(run, cu, target, pool, idx, accepted, has_init)


@pytest.mark.parametrize("backend", BACKENDS_SLOW)
def test_spec_continuation_matches_fresh_run(backend):
    """For each accepted count a, continuing from column a-1 equals a plain run over the accepted prefix
    followed by the next step's tokens."""
    h, p, g, n, k_spec = 2, 4, 1, 8, 3
    x, dt, a, b, c, d, _ = make_inputs([2 * (k_spec + 1)], h, p, g, n)
    draft, nxt = slice(0, k_spec + 1), slice(k_spec + 1, 2 * (k_spec + 1))
    base = make_pool(2 * (k_spec + 1), (h, p, n), [0])
    cu = torch.tensor([0, k_spec + 1], dtype=torch.int32)
    cols = torch.arange(k_spec + 1, dtype=torch.int32).view(1, -1)    # slot of column j: j
    for acc in range(1, k_spec + 2):
        pool = base.clone()
        recurrent(x[draft], dt[draft], a, b[draft], c[draft], d, pool, cu, cols,
                  num_valid=torch.tensor([1], dtype=torch.int32), backend=backend)
        y_cont = recurrent(x[nxt], dt[nxt], a, b[nxt], c[nxt], d, pool, cu, cols,
                           num_valid=torch.tensor([acc], dtype=torch.int32), backend=backend)
        fresh_pool = base.clone()
        tok = torch.cat([torch.arange(acc), torch.arange(k_spec + 1, 2 * (k_spec + 1))])
        y_fresh = recurrent(x[tok], dt[tok], a, b[tok], c[tok], d, fresh_pool,
                            torch.tensor([0, acc + k_spec + 1], dtype=torch.int32),
                            torch.tensor([0], dtype=torch.int32), backend=backend)
        assert_same_run(backend, f"y a={acc}", y_fresh[acc:], y_cont, RECURRENT_RATIO)
        assert_same_run(backend, f"state a={acc}", fresh_pool[0], pool[int(cols[0, -1])], RECURRENT_RATIO)


@pytest.mark.parametrize("backend", BACKENDS_SLOW)
def test_chunk_prefix_then_recurrent_matches_one_chunk_pass(backend):
    lens, split = [40, 21], [35, 18]
    x, dt, a, b, c, d, cu = make_inputs(lens, 2, 4, 2, 8)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    has_init = torch.tensor([False, True])
    pool = make_pool(3, (2, 4, 8), [0, 2])
    whole_pool = pool.clone()
    y_whole = chunk(x, dt, a, b, c, d, whole_pool, cu, idx, has_init, chunk_size=16, backend=backend)
    head, head_cu, tail, tail_cu = split_rows(cu, split)
    chunk(x[head], dt[head], a, b[head], c[head], d, pool, head_cu, idx, has_init, chunk_size=16,
          backend=backend)
    y_tail = recurrent(x[tail], dt[tail], a, b[tail], c[tail], d, pool, tail_cu, idx, backend=backend)
    assert_close("y tail", y_whole[tail], y_tail, CHUNK_RATIO)
    assert_close("state", whole_pool, pool, CHUNK_RATIO)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pad_rows_read_and_write_nothing(backend):
    x, dt, a, b, c, d, cu = make_inputs([3, 2], 1, 4, 1, 8)
    pool = torch.full((2, 1, 4, 8), HUGE)
    idx = torch.full((2,), PAD_SLOT_ID, dtype=torch.int32)
    before = pool.clone()
    y = recurrent(x, dt, a, b, c, d, pool, cu, idx, backend=backend)
    y_chunk = chunk(x, dt, a, b, c, d, pool, cu, idx, None, chunk_size=16, backend=backend)
    assert torch.equal(y, torch.zeros_like(y)) and torch.equal(y_chunk, torch.zeros_like(y_chunk))
    assert torch.equal(pool, before)


@pytest.mark.cpu_only
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "spec"])
def test_reference_batch_invariance_large_batch(spec):
    """Enough rows that torch's CPU reductions are split across threads: still bitwise the same."""
    rows, h, p, g, n, k_spec, target = 48, 4, 16, 2, 32, 3, 5
    lens = torch.randint(0 if not spec else 1, k_spec + 2, (rows,)).tolist()
    lens[target] = k_spec + 1
    x, dt, a, b, c, d, cu = make_inputs(lens, h, p, g, n)
    cols = k_spec + 1 if spec else 1
    idx = index_table(torch.randperm(rows * cols), rows, spec, pad_rows=slice(None, None, 7))  # not target 5
    accepted = torch.randint(1, k_spec + 2, (rows,), dtype=torch.int32) if spec else None
    pool = make_pool(rows * cols, (h, p, n), range(rows * cols))
    batch_pool, alone_pool = pool.clone(), pool.clone()
    y_batch = recurrent(x, dt, a, b, c, d, batch_pool, cu, idx, num_valid=accepted, backend="torch")
    one = slice(target, target + 1)
    tok, one_cu = rows_of(cu, one)
    y_alone = recurrent(x[tok], dt[tok], a, b[tok], c[tok], d, alone_pool, one_cu, idx[one],
                        num_valid=None if accepted is None else accepted[one], backend="torch")
    assert_row_alone_matches_batch(cu, target, idx, y_batch, y_alone, batch_pool, alone_pool)


SWEEP = [  # lens, H, P, G, N, chunk_size
    ([300, 1, 77], 8, 64, 2, 128, 128),
    ([200], 4, 32, 4, 64, 64),
    ([65, 64, 63], 4, 16, 1, 16, 16),
]


@requires_triton
@pytest.mark.slow
@pytest.mark.parametrize("lens,h,p,g,n,bt", [pytest.param(*c, id="L{}-H{}-P{}-G{}-N{}-BT{}".format(*c))
                                             for c in SWEEP])
def test_sweep_triton_matches_reference(lens, h, p, g, n, bt):
    x, dt, a, b, c, d, cu = make_inputs(lens, h, p, g, n)
    rows = len(lens)
    idx = torch.arange(rows, dtype=torch.int32)
    has_init = torch.ones(rows, dtype=torch.bool)
    starts = torch.arange(rows, dtype=torch.int32) * 37
    pool = make_pool(rows, (h, p, n), range(rows))
    pools = {name: pool.clone() for name in ("ref", "rec", "chunk")}
    ref = recurrent(x, dt, a, b, c, d, pools["ref"], cu, idx, has_initial_state=has_init, backend="torch")
    rec = recurrent(x, dt, a, b, c, d, pools["rec"], cu, idx, has_initial_state=has_init, backend="triton")
    out = chunk(x, dt, a, b, c, d, pools["chunk"], cu, idx, has_init, start_positions=starts, chunk_size=bt,
                backend="triton")
    assert_close("recurrent y", ref, rec, RECURRENT_RATIO)
    assert_close("recurrent state", pools["ref"], pools["rec"], RECURRENT_RATIO)
    assert_close("chunk y", ref, out, CHUNK_RATIO)
    assert_close("chunk state", pools["ref"], pools["chunk"], CHUNK_RATIO)
