"""What the chunked GDN phases share: the chunk-slot numbering and the tile geometry.

Chunk slots. Row i's chunks take the slots from ``cu[i] // BT + i`` on, so ``T // BT + N`` slots cover
every chunk of every row without a host read of ``cu_seqlens`` (a row over-counts by at most one slot;
a program whose slot holds no chunk returns at once). A program finds its row by comparing its slot
with every row's first slot; chunk c of row i covers tokens ``cu[i] + c * BT`` up to ``cu[i + 1]``.

Tile geometry. Every ``Dk`` tile is ``KTILE = 64`` wide (masked past Dk), whatever Dk: a float32 row
of 64 elements is 256 bytes, so on sm_90 every operand Triton stages for a ``wgmma`` is laid out with
the 128-byte swizzle. Narrower tiles give the 64-byte swizzle the H100 run failed with (Dk = 16,
chunk 64; kernels/gated_delta_rule/README.md). The state kernel's ``[KTILE, BV]`` tiles and the
contract's ``Dk <= 256`` follow: four tiles at most.
"""

from __future__ import annotations

import triton
import triton.language as tl

KTILE_SIZE = 64
KTILE = tl.constexpr(KTILE_SIZE)  # the same, for jit functions
MAX_K_TILES = 4
MIN_DOT_K = 32  # the narrowest float32 extent a tl.dot reduces over on sm_90 here (128 bytes)


def num_slots(num_tokens: int, num_rows: int, chunk_size: int) -> int:
    """Chunk slots of a launch (module docstring)."""
    return num_tokens // chunk_size + num_rows


def k_tiles(dk: int) -> int:
    """``KTILE``-wide tiles covering Dk."""
    nk = triton.cdiv(dk, KTILE_SIZE)
    assert nk <= MAX_K_TILES, f"Dk={dk}: the chunk kernels take Dk <= {MAX_K_TILES * KTILE_SIZE}"
    return nk


@triton.jit
def row_of_slot(cu_seqlens, i_s, N, BT: tl.constexpr, BN: tl.constexpr):
    """(row, chunk within the row) of chunk slot ``i_s``; ``BN >= N`` (a power of two)."""
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    b_first = tl.load(cu_seqlens + o_n, mask=m_n, other=0) // BT + o_n
    i_n = tl.sum(tl.where(m_n & (b_first <= i_s), 1, 0), 0) - 1
    i_c = i_s - (tl.load(cu_seqlens + i_n) // BT + i_n)
    return i_n, i_c


@triton.jit
def chunk_bounds(cu_seqlens, i_s, N, BT: tl.constexpr, BN: tl.constexpr):
    """(row, first token of the chunk, end of the row) of slot ``i_s``, token offsets in int64; the
    slot holds no chunk when the first token is not before the end."""
    i_n, i_c = row_of_slot(cu_seqlens, i_s, N, BT, BN)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return i_n, bos + i_c * BT, eos
