"""Prefix caching for hybrid models: shared KV blocks and recurrent-state checkpoints.

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

A hit of ``h`` tokens (a multiple of the block size) needs every KV block of the first ``h`` tokens
and a checkpoint at ``h``; ``h <= num_tokens - 1`` since the last token's logits must be computed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Publish:
    """The state at boundary ``boundary`` (tokens) of a request sits at column ``column`` of its last
    step: the conv window at columns ``column .. column+W-2`` of s_0 and the recurrent state in
    ``s_column``; ``slot`` is the checkpoint slot it is copied into."""

    boundary: int
    column: int
    slot: int


def state_column(boundary: int, num_computed_before: int, num_tokens: int, is_prefill: bool) -> int | None:
    """Where a step's output holds the state after ``boundary`` tokens, or None if it holds none.

    A prefill row keeps only its final state (column 0, when its chunk ends at ``boundary``); a verify
    row keeps the state after each of its tokens j in column j (contract 1).
    """
    j = boundary - num_computed_before - 1
    if is_prefill:
        return 0 if num_computed_before + num_tokens == boundary else None
    return j if 0 <= j < num_tokens else None


@dataclass(frozen=True)
class Hit:
    num_tokens: int  # h: tokens whose KV and state come from the cache
    blocks: list[int]  # the KV blocks of those tokens
    slot: int | None  # the checkpoint slot holding the state after them (None when h == 0)


class PrefixCache:
    """The scheduler's prefix cache: keys, the shared KV block pool, checkpoints and hit counters.

    ``mode`` decides only where prefill chunks end (``clip``); a state is published wherever a
    committed step leaves it at a block boundary (``publish``): every boundary a verify step keeps, and
    the end of a prefill chunk that ends on the grid.
    """

    def __init__(self, kv_pool: BlockPool, checkpoints: CheckpointPool, block_size: int, mode: str,
                 lookahead: int):
        self.kv_pool = kv_pool
        self.checkpoints = checkpoints
        self.block_size = block_size
        self.mode = mode
        self.lookahead = lookahead  # tokens past a block its key covers (1 with a KV-cached drafter)
        self.num_query_tokens = 0  # tokens looked up on admission (prompt plus outputs when resumed)
        self.num_hit_tokens = 0  # of those, tokens served from the cache

    def keys(self, req) -> list[bytes]:
        return extend_keys(req.block_keys, req.all_token_ids, self.block_size, self.lookahead)

    def find(self, req, total: int) -> Hit:
        """The longest cached prefix of ``req``'s first ``total`` tokens, leaving its last token to
        compute."""
        best, blocks = 0, []
        for i, key in enumerate(self.keys(req)):
            if (i + 1) * self.block_size > total - 1:
                break
            block = self.kv_pool.lookup(key)
            if block is None:
                break
            blocks.append(block)
            if self.checkpoints.has(key):
                best = i + 1
        if best == 0:
            return Hit(0, [], None)
        return Hit(best * self.block_size, blocks[:best], self.checkpoints.lookup(self.keys(req)[best - 1]))

    def count(self, total: int, hit: Hit) -> None:
        self.num_query_tokens += total
        self.num_hit_tokens += hit.num_tokens

    def clip(self, num_computed: int, num_new: int, total: int) -> int:
        """A prefill chunk's length, clipped so that its end is a checkpoint the mode asks for.

        ``all``: a chunk never crosses a block boundary, so every full block's state is a chunk end.
        ``align`` (vLLM's ``_mamba_block_aligned_split``): a chunk that stops short of the last block
        boundary of the prompt ends on the grid; the chunk that would cross that boundary stops at
        it; the tail after it runs unclipped. A chunk shorter than a block is left as it is.
        """
        bs, end = self.block_size, num_computed + num_new
        if self.mode == "all":
            return min(end, (num_computed // bs + 1) * bs) - num_computed
        last = total - total % bs
        if end < last:
            aligned = end - end % bs
            return aligned - num_computed if aligned > num_computed else num_new
        if num_computed < last < end:
            return last - num_computed
        return num_new

    def publish(self, req, block_ids: list[int], num_computed_before: int, limit: int, num_tokens: int,
                is_prefill: bool) -> list[Publish]:
        """Publish the KV blocks (``block_ids``, referenced) of ``req`` that end in
        ``(num_computed_before, limit]`` (committed tokens) and reserve a checkpoint for every such
        boundary whose state the step left (see ``state_column``). Returns the state copies to make."""
        out = []
        for b, key in self.publish_blocks(req, block_ids, num_computed_before, limit).items():
            column = state_column(b, num_computed_before, num_tokens, is_prefill)
            if column is None:
                continue
            slot = self.checkpoints.reserve(key)
            if slot is not None:
                out.append(Publish(b, column, slot))
        return out

    def publish_blocks(self, req, block_ids: list[int], num_computed_before: int,
                       limit: int) -> dict[int, bytes]:
        """Publish the KV blocks of ``req`` that end in ``(num_computed_before, limit]`` (committed tokens
        whose key is known); returns boundary -> key for each."""
        out = {}
        keys = self.keys(req)
        bs = self.block_size
        for b in range((num_computed_before // bs + 1) * bs, limit + 1, bs):
            i = b // bs - 1
            if i >= len(keys):
                break
            self.kv_pool.publish(block_ids[i], keys[i])
            out[b] = keys[i]
        return out
