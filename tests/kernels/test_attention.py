"""paged_attention: the reference against dense float64 attention, the Triton kernel against the
reference, and batch / chunking invariance (bitwise)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kernels._testing import assert_close
from kernels.attention import check_block_size, naive_paged_attention, paged_attention
from tests.kernels.conftest import generator, requires_triton

K_SPEC = 3  # speculative tokens: a verify row has 1 + K_SPEC query tokens


class Batch:
    """A varlen batch over a paged cache. ``rows``: (context length, query length) per row.

    Cache slots that hold no key are NaN, and unused block-table entries point far out of range,
    so reading either shows up as NaN or an error.
    """

    def __init__(self, rows, block_size, hq, hkv, d, *, dtype=torch.float32, pad_tokens=0, seed=0):
        gen = generator(seed)
        self.rows, self.block_size, self.hq, self.hkv, self.d = rows, block_size, hq, hkv, d
        self.seq_lens = [ctx + qlen for ctx, qlen in rows]
        blocks_per_row = [math.ceil(s / block_size) for s in self.seq_lens]
        num_blocks = sum(blocks_per_row) + 3
        max_blocks = max(blocks_per_row + [1]) + 2
        perm = torch.randperm(num_blocks, generator=gen)
        self.block_table = torch.full((len(rows), max_blocks), num_blocks + 10**6, dtype=torch.int32)
        self.k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        self.keys, self.values = [], []
        used = 0
        for i, s in enumerate(self.seq_lens):
            self.block_table[i, : blocks_per_row[i]] = perm[used : used + blocks_per_row[i]].int()
            used += blocks_per_row[i]
            keys = torch.randn(s, hkv, d, generator=gen).to(dtype)
            values = torch.randn(s, hkv, d, generator=gen).to(dtype)
            pos = torch.arange(s)
            blocks = self.block_table[i, pos // block_size].long()
            self.k_cache[blocks, pos % block_size] = keys
            self.v_cache[blocks, pos % block_size] = values
            self.keys.append(keys)
            self.values.append(values)
        qlens = torch.tensor([qlen for _, qlen in rows], dtype=torch.int32)
        self.query_start_loc = torch.zeros(len(rows) + 1, dtype=torch.int32)
        self.query_start_loc[1:] = torch.cumsum(qlens, 0)
        num_tokens = int(self.query_start_loc[-1]) + pad_tokens
        self.q = torch.randn(num_tokens, hq, d, generator=gen).to(dtype)
        self.scale = d**-0.5

    def args(self):
        seq_lens = torch.tensor(self.seq_lens, dtype=torch.int32)
        return self.q, self.k_cache, self.v_cache, self.query_start_loc, seq_lens, self.block_table

    def run(self, backend):
        return paged_attention(*self.args(), scale=self.scale, backend=backend)

    def dense_row(self, i):
        """Float64 ``softmax(q K^T * scale + causal mask) V`` on row i's gathered keys."""
        ctx, qlen = self.rows[i]
        start = int(self.query_start_loc[i])
        group = self.hq // self.hkv
        q = self.q[start : start + qlen].double()
        keys = self.keys[i].double().repeat_interleave(group, dim=1)
        values = self.values[i].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, keys) * self.scale
        q_pos = ctx + torch.arange(qlen)
        hidden = torch.arange(ctx + qlen)[None, :] > q_pos[:, None]
        scores = scores.masked_fill(hidden[None], float("-inf"))
        return torch.einsum("hts,shd->thd", scores.softmax(-1), values)


def case_id(rows, block_size, hq, hkv, d):
    return f"rows{'_'.join(f'{c}+{q}' for c, q in rows)}-bs{block_size}-hq{hq}-hkv{hkv}-d{d}"


# Query lengths 1, 2, K+1, 17, 63, 65 with earlier context; mixed batches with 0-length rows.
MIXED = [(0, 17), (5, 1), (0, 0), (30, K_SPEC + 1), (13, 2), (0, 0), (3, 63)]
REFERENCE_CASES = [
    ([(0, 1)], 16, 2, 2, 16),
    ([(0, 65)], 4, 4, 1, 12),
    ([(40, 65), (7, 1)], 16, 4, 2, 20),
    (MIXED, 4, 4, 4, 12),
    (MIXED, 16, 8, 2, 20),
    ([(100, 1), (0, 0), (64, K_SPEC + 1), (15, 17)], 16, 4, 1, 16),
]
TRITON_CASES = [
    ([(0, 1)], 16, 2, 2, 16),
    ([(0, 17), (5, 1), (0, 0), (30, K_SPEC + 1), (13, 2)], 4, 4, 4, 12),
    ([(21, 1), (0, 0), (9, K_SPEC + 1), (0, 65)], 16, 4, 1, 20),
    ([(3, 63), (48, 2), (0, 0)], 16, 4, 2, 16),
]
TRITON_SLOW_CASES = [
    (MIXED, 16, 8, 2, 20),
    ([(40, 65), (7, 1), (0, 0)], 4, 4, 1, 12),
    ([(100, 1), (0, 0), (64, K_SPEC + 1), (15, 17)], 16, 4, 4, 16),
    ([(0, 63), (17, 65), (2, 1), (0, 0)], 16, 6, 2, 12),
]


def params(cases):
    return [pytest.param(*c, id=case_id(*c)) for c in cases]


@pytest.mark.parametrize("rows, block_size, hq, hkv, d", params(REFERENCE_CASES))
def test_reference_matches_dense_float64(rows, block_size, hq, hkv, d):
    batch = Batch(rows, block_size, hq, hkv, d, pad_tokens=3)
    out = batch.run("torch")
    for i, (_, qlen) in enumerate(rows):
        start = int(batch.query_start_loc[i])
        if qlen:
            assert_close(f"row{i}", batch.dense_row(i), out[start : start + qlen], 1e-5)
    assert not out.isnan().any()
    assert torch.all(out[int(batch.query_start_loc[-1]) :] == 0), "padding tokens must be zeros"


def test_reference_bfloat16_cache():
    batch = Batch(MIXED, 16, 4, 2, 16, dtype=torch.bfloat16)
    out = batch.run("torch")
    assert out.dtype == torch.bfloat16
    for i, (_, qlen) in enumerate(MIXED):
        start = int(batch.query_start_loc[i])
        if qlen:
            assert_close(f"row{i}", batch.dense_row(i), out[start : start + qlen], 1e-2)


def check_triton(rows, block_size, hq, hkv, d, dtype=torch.float32):
    batch = Batch(rows, block_size, hq, hkv, d, dtype=dtype, pad_tokens=2)
    ref, tri = batch.run("torch"), batch.run("triton")
    assert tri.dtype == dtype
    assert_close("o", ref.float(), tri.float(), 2e-3 if dtype == torch.float32 else 1e-2)
    assert torch.all(tri[int(batch.query_start_loc[-1]) :] == 0), "padding tokens must be zeros"


@requires_triton
@pytest.mark.parametrize("rows, block_size, hq, hkv, d", params(TRITON_CASES))
def test_triton_matches_reference(rows, block_size, hq, hkv, d):
    check_triton(rows, block_size, hq, hkv, d)


@requires_triton
def test_triton_bfloat16():
    check_triton([(9, K_SPEC + 1), (0, 0), (30, 1), (0, 17)], 16, 4, 2, 16, dtype=torch.bfloat16)


@requires_triton
@pytest.mark.slow
@pytest.mark.parametrize("rows, block_size, hq, hkv, d", params(TRITON_SLOW_CASES))
def test_triton_matches_reference_sweep(rows, block_size, hq, hkv, d):
    check_triton(rows, block_size, hq, hkv, d)


def single_row(batch, i):
    """Row i of ``batch`` as a batch of its own (same cache, same block-table row)."""
    start, end = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
    return (
        batch.q[start:end],
        batch.k_cache,
        batch.v_cache,
        torch.tensor([0, end - start], dtype=torch.int32),
        torch.tensor([batch.seq_lens[i]], dtype=torch.int32),
        batch.block_table[i : i + 1],
    )


def chunked_row(batch, i, bounds, backend):
    """Row i's query processed in chunks ``[bounds[j], bounds[j+1])``, each call padded with a
    zero-length row and two padding tokens."""
    ctx, _ = batch.rows[i]
    start = int(batch.query_start_loc[i])
    outs = []
    for a, b in itertools.pairwise(bounds):
        q = torch.cat(
            [batch.q[start + a : start + b], torch.randn(2, batch.hq, batch.d, dtype=batch.q.dtype)]
        )
        qsl = torch.tensor([0, 0, b - a], dtype=torch.int32)
        seq_lens = torch.tensor([5, ctx + b], dtype=torch.int32)
        table = torch.stack([batch.block_table[(i + 1) % len(batch.rows)], batch.block_table[i]])
        o = paged_attention(
            q, batch.k_cache, batch.v_cache, qsl, seq_lens, table, scale=batch.scale, backend=backend
        )
        outs.append(o[: b - a])
    return torch.cat(outs)


@pytest.mark.cpu_only
@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_batch_invariance(block_size):
    batch = Batch(MIXED, block_size, 4, 2, 12, pad_tokens=5)
    full = batch.run("torch")
    for i, (_, qlen) in enumerate(MIXED):
        start = int(batch.query_start_loc[i])
        alone = naive_paged_attention(*single_row(batch, i), scale=batch.scale)
        assert torch.equal(alone, full[start : start + qlen]), f"row {i} differs alone vs batched"


@pytest.mark.cpu_only
@pytest.mark.parametrize("rows, block_size, hq, hkv, d",
                         params([*REFERENCE_CASES, ([(0, 65), (7, 1), (21, 40)], 3, 4, 1, 20)]))
def test_reference_gives_the_same_bits_tile_by_tile_and_all_tiles_at_once(rows, block_size, hq, hkv, d,
                                                                          monkeypatch):
    """The reference computes every tile at once for decode-like calls and tile by tile for prefills
    (kernels/attention/naive.py): both orders of the work must give the same bits on any call."""
    from kernels.attention import naive

    batch = Batch(rows, block_size, hq, hkv, d, pad_tokens=2)
    outs = []
    for at_once in (True, False):
        monkeypatch.setattr(naive, "all_tiles_at_once", lambda seen, elements, at_once=at_once: at_once)
        outs.append(naive_paged_attention(*batch.args(), scale=batch.scale))
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
    assert not outs[0].isnan().any()


@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_chunking_invariance(block_size):
    batch = Batch([(0, 65), (7, 1), (21, 40)], block_size, 4, 1, 20)
    full = batch.run("torch")
    for i, bounds in [(0, [0, 1, 17, 18, 50, 65]), (0, [0, 64, 65]), (2, [0, 3, 4, 7, 40])]:
        start, qlen = int(batch.query_start_loc[i]), batch.rows[i][1]
        got = chunked_row(batch, i, bounds, "torch")
        assert torch.equal(got, full[start : start + qlen]), f"row {i} differs chunked {bounds} vs one call"


@requires_triton
def test_triton_batch_and_chunking_invariance():
    batch = Batch([(0, 21), (3, 1), (0, 0), (9, K_SPEC + 1)], 4, 2, 1, 12)
    full = batch.run("triton")
    for i, (_, qlen) in enumerate(batch.rows):
        start = int(batch.query_start_loc[i])
        alone = paged_attention(*single_row(batch, i), scale=batch.scale, backend="triton")
        assert torch.equal(alone, full[start : start + qlen]), f"row {i} differs alone vs batched"
    got = chunked_row(batch, 0, [0, 5, 6, 21], "triton")
    assert torch.equal(got, full[:21]), "row 0 differs chunked vs one call"


@requires_triton
def test_triton_takes_a_strided_head_dim_as_the_reference_does():
    # q as a slice of a wider projection: the wrapper copies it (the kernel needs a unit stride there).
    batch = Batch([(5, 3), (0, 2)], 16, 2, 2, 16)
    q, *rest = batch.args()
    q_strided = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2])
    q_strided[:, :, ::2] = q
    q_strided = q_strided[:, :, ::2]
    expected = paged_attention(q, *rest, scale=batch.scale, backend="torch")
    assert_close("o", expected, paged_attention(q_strided, *rest, scale=batch.scale, backend="triton"), 2e-3)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32, 64])
def test_check_block_size_accepts_what_the_triton_kernel_takes(block_size):
    check_block_size(block_size)


@pytest.mark.parametrize("block_size", [0, -16, 12, 48, 128, 16.0, True, "16"])
def test_check_block_size_refuses_naming_the_setting(block_size):
    with pytest.raises(ValueError, match="block_size"):
        check_block_size(block_size)


@requires_triton
def test_triton_attention_refuses_a_block_size_it_cannot_take():
    batch = Batch([(0, 3)], 48, 2, 2, 16)  # 48-token blocks: not a power of two
    with pytest.raises(ValueError, match="block_size=48"):
        paged_attention(*batch.args(), scale=batch.scale, backend="triton")
