"""The recurrent state-slot pool (KV blocks live in ``refengine.prefix_cache.BlockPool``, which also
shares them between requests).

A pool of integer ids handed out last-freed-first, so recycled ids come back quickly. Freed state
slots are recycled without zeroing: a new request must never depend on what a slot held before
(classification gives it a zero initial state instead).
"""

from __future__ import annotations


class IdPool:
    def __init__(self, name: str, size: int):
        self.name = name
        self.size = size
        self._free: list[int] = list(range(size - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` ids, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise RuntimeError(f"{self.name} pool: id {i} freed twice or never allocated")
            self._used.remove(i)
        self._free.extend(reversed(ids))


def StateSlotPool(num_slots: int) -> IdPool:
    return IdPool("state-slot", num_slots)
