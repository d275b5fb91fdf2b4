"""The scheduler's prefix cache: lookups and chunk stops at admission, and the step protocol.

A hit of ``h`` tokens (a multiple of the block size) needs every KV block of the first ``h`` tokens
and a checkpoint at ``h``; ``h <= num_tokens - 1`` since the last token's logits must be computed.

The step protocol, the same for both engines (``ReferenceEngine._step`` is its plain form):

1. **restore**: the scheduler's output carries a ``Restore`` for each request it admitted on a hit;
   the engine copies that checkpoint into the request's s_0 before the step reads it.
2. **hold**: once the step's output is known and before its tokens are committed, ``hold`` takes a
   reference on the blocks of every row that may publish (a request that finishes while the step is
   committed frees its own references, and its last step's blocks still publish).
3. **publish**: once the tokens are committed (and the drafter wrote its KV at them), ``publish``
   caches every KV block whose tokens the row committed and names the checkpoints to write: one per
   block boundary whose state the row's output holds (``geometry.reached``). The engine writes them
   (the reference engine copies the state; the async engine keys the slot its program copied it into).
4. **release**: whatever happened, ``release`` drops the references ``hold`` took.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refengine.prefix_cache import geometry
from refengine.prefix_cache.pools import BlockPool, CheckpointPool, extend_keys


@dataclass(frozen=True)
class Hit:
    num_tokens: int  # h: tokens whose KV and state come from the cache
    blocks: list[int]  # the KV blocks of those tokens
    checkpoint: int | None  # the checkpoint slot holding the state after them (None when h == 0)
    num_shared: int = 0  # tokens of the longest run of cached KV blocks (>= h): where the request stops
    #                      sharing what the cache holds


@dataclass(frozen=True)
class Restore:
    """Copy checkpoint ``checkpoint`` into ``slot`` (the s_0 of ``request_id``) before the step runs."""

    request_id: str
    checkpoint: int
    slot: int


@dataclass
class Span:
    """One row of a step as the prefix cache sees it: its request committed ``(start, start + kept]``."""

    request: object  # the Request
    start: int  # committed tokens before the step (the row's first position)
    num_tokens: int  # the row's query length
    kept: int  # tokens of the query now committed: the whole chunk for a prefill, num_valid for a verify row
    is_prefill: bool
    state_slots: list[int]  # the request's s_0..s_K during the step (where its output states are)
    held: list[int] = field(default_factory=list)  # async: the checkpoint slot staged per boundary p
    blocks: list[int] = field(default_factory=list)  # the request's blocks, referenced from hold to release


@dataclass(frozen=True)
class Checkpoint:
    """The state at the ``index``-th boundary a span reached is column ``column`` of its output; store it
    under ``key``."""

    span: Span
    index: int
    column: int
    key: bytes


class PrefixCache:
    """Keys, the shared KV block pool, checkpoints and hit counters.

    ``mode`` decides only where prefill chunks stop (``clip``); a state is published wherever a committed
    step leaves it on a block boundary: every boundary a verify step keeps, and the end of a prefill
    chunk on the grid.
    """

    def __init__(self, kv_pool: BlockPool, checkpoints: CheckpointPool, block_size: int, mode: str,
                 lookahead: int, drop_last_block: bool = False):
        self.kv_pool = kv_pool
        self.checkpoints = checkpoints
        self.block_size = block_size
        self.mode = mode
        self.lookahead = lookahead  # tokens past a block its key covers (1 with a KV-cached drafter)
        # vLLM's rule for EAGLE-style drafters: a hit drops the last block of its matched KV run (the
        # drafter's KV at the block's last position pairs it with the token after the block)
        self.drop_last_block = drop_last_block
        self.num_query_tokens = 0  # tokens looked up on admission (prompt plus outputs when resumed)
        self.num_hit_tokens = 0  # of those, tokens served from the cache

    def keys(self, req) -> list[bytes]:
        return extend_keys(req.block_keys, req.all_token_ids, self.block_size, self.lookahead)

    # ---- admission -------------------------------------------------------------------------------
    def find(self, req, total: int) -> Hit:
        """The longest cached prefix of ``req``'s first ``total`` tokens, leaving its last token to
        compute; ``num_shared`` is where its run of cached KV blocks ends. With ``drop_last_block`` the run
        loses its last block first, and the hit is the last checkpoint inside what is left."""
        best, blocks = 0, []
        keys = self.keys(req)
        for i, key in enumerate(keys):
            if (i + 1) * self.block_size > total - 1:
                break
            block = self.kv_pool.lookup(key)
            if block is None:
                break
            blocks.append(block)
        shared = len(blocks) * self.block_size
        if self.drop_last_block:
            blocks = blocks[:-1]
        for i in range(len(blocks)):
            if self.checkpoints.has(keys[i]):
                best = i + 1
        if best == 0:
            return Hit(0, [], None, shared)
        slot = self.checkpoints.lookup(keys[best - 1])
        return Hit(best * self.block_size, blocks[:best], slot, shared)

    def count(self, total: int, hit: Hit) -> None:
        self.num_query_tokens += total
        self.num_hit_tokens += hit.num_tokens

    def clip(self, num_computed: int, num_new: int, total: int, shared: int = 0) -> int:
        """A prefill chunk's length, stopped where the mode wants a checkpoint.

        ``all``: a chunk never crosses a block boundary, so every full block's state is a chunk end.
        ``align`` (vLLM 0.32+ ``_mamba_block_aligned_split``): a chunk that stops short of the prompt's
        end ends on the grid (unless that leaves it nothing); then it stops at the first of these inside
        it: the next boundary when it starts off the grid, the prompt's last checkpoint
        (``geometry.last_checkpoint``, the longest hit a request with the same prompt can get), and
        ``shared``, where the request stops sharing the cache's blocks (so a later request with the same
        prefix hits there).
        """
        bs, end = self.block_size, num_computed + num_new
        if self.mode == "all":
            return min(end, (num_computed // bs + 1) * bs) - num_computed
        if end < total and end - end % bs > num_computed:
            end -= end % bs
        last = geometry.last_checkpoint(total, bs, self.lookahead, self.drop_last_block)
        stops = [last, shared - shared % bs]
        if num_computed % bs:
            stops.append((num_computed // bs + 1) * bs)
        inside = [s for s in stops if num_computed < s < end]
        return (min(inside) if inside else end) - num_computed

    # ---- the step protocol ---------------------------------------------------------------------------
    def hold(self, spans: list[Span]) -> None:
        """A reference on each span's blocks until ``release``."""
        for span in spans:
            span.blocks = list(span.request.block_ids)
            self.kv_pool.take(span.blocks)

    def publish(self, spans: list[Span]) -> list[Checkpoint]:
        """Cache the KV blocks each span committed; the checkpoints to store, one per boundary it reached."""
        out = []
        for span in spans:
            keys = self._publish_blocks(span)
            bs = self.block_size
            for p, (b, column) in enumerate(geometry.reached(span.start, span.num_tokens, span.kept,
                                                             span.is_prefill, bs)):
                if b in keys:
                    out.append(Checkpoint(span, p, column, keys[b]))
        return out

    def release(self, spans: list[Span]) -> None:
        for span in spans:
            self.kv_pool.free(span.blocks)
            span.blocks = []

    def _publish_blocks(self, span: Span) -> dict[int, bytes]:
        """Cache the blocks that end in the span's committed tokens and whose key is known (boundary ->
        key)."""
        out = {}
        keys = self.keys(span.request)
        for b in geometry.boundaries(span.start, span.start + span.kept, self.block_size):
            i = b // self.block_size - 1
            if i >= len(keys):
                break
            self.kv_pool.publish(span.blocks[i], keys[i])
            out[b] = keys[i]
        return out
