"""The persistent batch: requests keep their row across steps; rows move only on purpose.

New requests take the first free row; finished and preempted requests leave holes; ``condense``
moves the last rows into the holes and ``reorder`` swaps rows into decode -> short extend ->
long extend -> prefill order, so a step's decode rows come first. Nothing per-request lives in
batch rows: the device keys its state by request slot, so a row move copies nothing.
"""

from __future__ import annotations

from itertools import pairwise

from refengine.request import Request

DECODE, SHORT_EXTEND, LONG_EXTEND, PREFILL = 0, 1, 2, 3


def row_category(req: Request, num_speculative_tokens: int) -> int:
    """Order key: decodes, then extends of at most 1+K tokens, longer extends, first chunks."""
    if not req.is_prefilling:
        return DECODE
    if not req.has_initial_state:
        return PREFILL
    remaining = req.num_prefill_tokens - req.num_computed_tokens
    return SHORT_EXTEND if remaining <= 1 + num_speculative_tokens else LONG_EXTEND


class PersistentBatch:
    def __init__(self, num_speculative_tokens: int):
        self.num_speculative_tokens = num_speculative_tokens
        self.rows: list[Request | None] = []
        self.num_moves = 0  # rows moved by condense and reorder, for stats and tests

    def add(self, req: Request) -> None:
        for i, r in enumerate(self.rows):
            if r is None:
                self.rows[i] = req
                return
        self.rows.append(req)

    def remove(self, req: Request) -> None:
        if req in self.rows:
            self.rows[self.rows.index(req)] = None

    def condense(self) -> None:
        """Fill holes with the last rows."""
        while True:
            while self.rows and self.rows[-1] is None:
                self.rows.pop()
            if None not in self.rows:
                return
            hole = self.rows.index(None)
            self._move(len(self.rows) - 1, hole)

    def _move(self, src: int, dst: int) -> None:
        self.rows[dst] = self.rows[src]
        self.rows[src] = None
        self.num_moves += 1

    def _swap(self, a: int, b: int) -> None:
        self.rows[a], self.rows[b] = self.rows[b], self.rows[a]
        self.num_moves += 1

    def reorder(self) -> None:
        """Selection by swaps into category order (stable enough; every swap is a real row move)."""
        keys = [row_category(r, self.num_speculative_tokens) for r in self.rows]
        if all(a <= b for a, b in pairwise(keys)):  # in order already (most steps): no swap below
            return
        for i in range(len(self.rows)):
            j = min(range(i, len(self.rows)), key=lambda t: (keys[t], t))
            if j != i and keys[j] < keys[i]:
                self._swap(i, j)
                keys[i], keys[j] = keys[j], keys[i]

    def order(self, scheduled: set[int]) -> list[Request]:
        """The scheduled requests in row order (by object identity)."""
        return [r for r in self.rows if r is not None and id(r) in scheduled]
