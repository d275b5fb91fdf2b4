"""Where a step's states sit: pure arithmetic on token counts, shared by both engines and the device copy.

A row of a step starts after ``start`` committed tokens and runs ``num_tokens`` (its query); ``kept`` of
them are committed when it is done (a prefill chunk keeps its whole query, a verify row the tokens the
verifier kept, bonus included). Block boundaries are multiples of ``block_size``.

Which column of the row's output holds the state after ``b`` tokens (contract 1):

- a prefill row keeps only its final state, column 0, so it holds a boundary only when its chunk ends
  there;
- a verify row keeps the state after its token ``j`` in column ``j``, so the boundary ``b`` sits in
  column ``b - start - 1``, kept iff that column is below ``kept``.

The p-th boundary after ``start`` is ``(start // block_size + 1 + p) * block_size``; its column depends
on ``start % block_size`` only, which is why the device copy reads columns from a ``[block_size, P]``
table (``column_table``) instead of recomputing the rule. Every function here takes ints; ``column``
and ``boundary`` take tensors too.
"""

from __future__ import annotations


def boundaries(after: int, through: int, block_size: int) -> range:
    """Block boundaries ``b`` with ``after < b <= through``."""
    return range((after // block_size + 1) * block_size, through + 1, block_size)


def num_boundaries(after: int, through: int, block_size: int) -> int:
    """How many block boundaries lie in ``(after, through]``."""
    return max(through // block_size - after // block_size, 0)


def boundary(start, p, block_size: int):
    """The p-th block boundary after ``start`` (ints or tensors)."""
    return (start // block_size + 1 + p) * block_size


def column(start, p, block_size: int):
    """The column of a verify row that starts at ``start`` holding the state at its p-th boundary (ints or
    tensors)."""
    return boundary(start, p, block_size) - start - 1


def column_table(block_size: int, num_columns: int) -> list[list[int]]:
    """``[block_size][num_columns]``: row ``start % block_size``, entry p is ``column(start, p)``."""
    return [[column(r, p, block_size) for p in range(num_columns)] for r in range(block_size)]


def ends_on_boundary(start, num_tokens, block_size: int):
    """Whether a prefill chunk of ``num_tokens`` after ``start`` ends on a block boundary, its state there
    (ints or tensors)."""
    return ((start + num_tokens) % block_size == 0) & (num_tokens > 0)


def reached(start: int, num_tokens: int, kept: int, is_prefill: bool,
            block_size: int) -> list[tuple[int, int]]:
    """(boundary, column) of every block boundary the row's committed tokens reached and whose state its
    output holds, in order: entry p is the row's p-th boundary (what the async engine's held slot p
    received)."""
    if is_prefill:
        return [(start + num_tokens, 0)] if ends_on_boundary(start, num_tokens, block_size) else []
    return [(boundary(start, p, block_size), column(start, p, block_size))
            for p in range(num_boundaries(start, start + kept, block_size))]


def last_checkpoint(num_tokens: int, block_size: int, lookahead: int, drop_last_block: bool = False) -> int:
    """``align``: the last block boundary a prompt of ``num_tokens`` keeps a state at, the longest hit a
    request with the same prompt can get: ``(L - max(1, lookahead)) // B * B`` (vLLM 0.32+), one block
    less (not below 0) when hits drop their last matched block (an EAGLE-style drafter)."""
    end = (num_tokens - max(1, lookahead)) // block_size * block_size
    return max(end - block_size, 0) if drop_last_block else end
