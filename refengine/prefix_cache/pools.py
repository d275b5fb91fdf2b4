"""The prefix cache's pools and block keys: shared KV blocks and recurrent-state checkpoints.

Keys. Block ``i`` of a request's tokens has the key ``H(key_{i-1}, tokens of block i [, token after
it])``: equal keys mean equal token prefixes. When the drafter keeps a KV cache (MTP), the entry at a
block's last position pairs that position's hidden state with the *next* token, so the key also covers
that token (``lookahead=1``); a key is computable only once that token is known.

KV blocks (``BlockPool``) are reference-counted. A block whose every token is committed may be
*published* under its key; when its last reference goes it stays cached (evictable, least recently
used first) until the pool needs it for a new allocation, which drops the key.

Checkpoints (``CheckpointPool``) are extra recurrent state slots, each holding the state after the
tokens of the block whose key it is stored under (the state *at the block's end*). They are copied
into a request's s_0 on a hit, so they hold no references; the least recently used goes first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

ROOT_KEY = b""


def next_key(parent: bytes, tokens: list[int]) -> bytes:
    data = parent + b"|" + ",".join(map(str, tokens)).encode()
    return hashlib.blake2b(data, digest_size=16).digest()


def extend_keys(keys: list[bytes], tokens: list[int], block_size: int, lookahead: int) -> list[bytes]:
    """Append to ``keys`` the key of every further block ``tokens`` covers (plus ``lookahead`` tokens)."""
    while (len(keys) + 1) * block_size + lookahead <= len(tokens):
        i = len(keys)
        parent = keys[-1] if keys else ROOT_KEY
        keys.append(next_key(parent, tokens[i * block_size: (i + 1) * block_size + lookahead]))
    return keys


class BlockPool:
    """Reference-counted KV block ids with a key -> block table and LRU eviction of unreferenced blocks."""

    def __init__(self, num_blocks: int):
        self.name = "kv-block"
        self.size = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # never cached, or evicted
        self._refs: dict[int, int] = {}  # block -> references (> 0)
        self._key_of: dict[int, bytes] = {}  # published block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> published block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced published blocks, LRU first

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def lookup(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def cached(self) -> dict[bytes, int]:
        """Every published key and its block (a copy)."""
        return dict(self._block_of)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (evicting the least recently used cached ones), or None and nothing taken."""
        if n > self.num_free:
            return None
        ids = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
            self._refs[block] = 1
            ids.append(block)
        return ids

    def take(self, blocks: list[int]) -> None:
        """One more reference on each of ``blocks``: published blocks a hit shares, or blocks a holder keeps
        alive past their owner's release."""
        for block in blocks:
            if block not in self._key_of and block not in self._refs:
                raise RuntimeError(f"{self.name} pool: block {block} is neither cached nor referenced")
            self._evictable.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            n = self._refs.get(block, 0)
            if n <= 0:
                raise RuntimeError(f"{self.name} pool: block {block} freed twice or never allocated")
            if n > 1:
                self._refs[block] = n - 1
                continue
            del self._refs[block]
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def publish(self, block: int, key: bytes) -> bool:
        """Cache referenced ``block`` under ``key``; False when the key or the block is cached already."""
        if self._refs.get(block, 0) <= 0:
            raise RuntimeError(f"{self.name} pool: block {block} is not referenced and cannot be published")
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True


class CheckpointPool:
    """Recurrent state checkpoints: ``num_slots`` slot ids from ``first_slot`` on, keyed by block key.

    With ``num_staging`` (the async engine) the next ``num_staging`` slot ids start as *staging* slots:
    a step in flight may copy the state at a block boundary into one before the host knows the
    block's key (``hold``). Once the step is processed the host keys it (``keep``: it joins the
    checkpoints, and the slot they give up for it, free or the least recently used checkpoint's, exactly
    as ``reserve`` would pick, becomes a staging slot) or frees it (``release``). So holding never
    evicts a checkpoint, and the checkpoints evict as the reference engine's do.
    """

    def __init__(self, first_slot: int, num_slots: int, num_staging: int = 0):
        self._free: list[int] = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        first_staging = first_slot + num_slots
        self._staging: list[int] = list(range(first_staging + num_staging - 1, first_staging - 1, -1))
        self._held: set[int] = set()  # staging slots a step in flight may write

    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def lookup(self, key: bytes) -> int | None:
        slot = self._slot_of.get(key)
        if slot is not None:
            self._slot_of.move_to_end(key)
        return slot

    def has(self, key: bytes) -> bool:
        return key in self._slot_of

    def cached(self) -> dict[bytes, int]:
        """Every checkpoint's key and its slot (a copy; reading it touches nothing)."""
        return dict(self._slot_of)

    def reserve(self, key: bytes) -> int | None:
        """A slot to write the checkpoint for ``key`` into (evicting the LRU one); None if ``key`` has one."""
        if key in self._slot_of:
            return None
        slot = self._take()
        self._slot_of[key] = slot
        return slot

    def _take(self) -> int:
        """A free slot, else the least recently used checkpoint's (its key dropped). Every one of the
        ``num_slots >= 1`` slots is one or the other."""
        if self._free:
            return self._free.pop()
        return self._slot_of.popitem(last=False)[1]

    def hold(self) -> int | None:
        """A staging slot for a checkpoint whose key is not known yet; None when every one is held."""
        if not self._staging:
            return None
        slot = self._staging.pop()
        self._held.add(slot)
        return slot

    def keep(self, slot: int, key: bytes) -> bool:
        """Make held ``slot`` the checkpoint of ``key``; False (and the slot freed) if ``key`` has one."""
        self._unhold(slot)
        if key in self._slot_of:
            self._staging.append(slot)
            return False
        self._staging.append(self._take())
        self._slot_of[key] = slot
        return True

    def release(self, slot: int) -> None:
        self._unhold(slot)
        self._staging.append(slot)

    def _unhold(self, slot: int) -> None:
        if slot not in self._held:
            raise RuntimeError(f"checkpoint slot {slot} released but not held")
        self._held.remove(slot)
