"""Prefix caching in the async engine: restores on hits, checkpoint slots held at planning, publishing
when a step is processed.

The scheduler (shared with the reference engine) finds hits and clips prefill chunks; a hit's KV
blocks are shared through the block table as usual. What differs from the reference engine is when
the host knows things:

- A hit's checkpoint is copied into the request's s_0 in the ``stage`` part of the step that first
  runs the request, on the device timeline, so it never waits for the step in flight.
- The host plans step N+1 before it knows how many of step N's drafts the verifier kept, so it knows
  neither which block boundary a verify row will reach nor that block's key (it hashes tokens not
  sampled yet). At planning it *holds* staging slots (``CheckpointPool.hold``) for every row that
  may reach a boundary: one for a prefill chunk that ends on the block grid, up to
  P = ceil((1 + K) / block_size) for a verify row whose possible positions cover a boundary. The step
  program copies the state at each boundary the kept tokens reached into its slot
  (``AsyncRunner.checkpoint``); the copy is masked, so the program reads nothing back.
- When step N is processed the host knows what was kept. Only then does it publish: the KV blocks
  whose every token is committed, and the held slots of the boundaries reached, under their keys
  (``CheckpointPool.keep``, which evicts as the reference engine's ``reserve`` does); the other
  slots are freed. Optimistic counts never decide what is published.

Publishing follows the reference engine's rule (``ReferenceEngine._publish``): every block boundary
a row's committed tokens reached, and a checkpoint wherever the step left the state on the grid; a
request that finished publishes nothing from its last step when the drafter keeps a KV cache (the
reference engine's drafter writes no entries for a finished request).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refengine.async_engine.optimistic import AsyncRequest
from refengine.prefix_cache import PrefixCache
from refengine.request import RequestStatus


@dataclass
class RowHold:
    """What prefix caching set aside for one row of a planned step."""

    request: AsyncRequest
    num_preemptions: int  # the request's preemptions at planning: one since then released its blocks
    is_prefill: bool
    start: int | None  # prefill rows: committed tokens before the chunk (exact at planning); else None
    slots: list[int]  # P checkpoint slots, entry p for the row's p-th boundary; the sink slot where none


@dataclass
class Span:
    """A processed row's committed tokens ``(start, limit]``, and its request's blocks, referenced until
    published (a request that finishes in this step frees its own references while committing)."""

    hold: RowHold
    blocks: list[int]
    start: int
    limit: int
    num_tokens: int  # the row's query length


class AsyncPrefixCache:
    def __init__(self, prefix: PrefixCache, num_columns: int, sink_slot: int, drafter_kv: bool):
        self.prefix = prefix
        self.block_size = prefix.block_size
        self.num_columns = num_columns  # P: boundaries one row's step can reach
        self.sink_slot = sink_slot
        self.drafter_kv = drafter_kv
        self._held: dict[int, set[int]] = {}  # plan index -> slots it still holds

    # ---- planning ---------------------------------------------------------------------------
    def stage(self, plan, admitted: list[AsyncRequest]) -> None:
        """Before the plan's optimistic assumptions: the restores of its hits and its held slots."""
        plan.restores = self.restores(admitted)
        plan.holds = [self.hold(row) for row in plan.rows]
        self._held[plan.index] = {s for h in plan.holds for s in h.slots if s != self.sink_slot}
        plan.checkpoint_idx = torch.tensor([row.request.idx for row in plan.rows], dtype=torch.int64)
        plan.checkpoint_rows = torch.tensor([h.slots for h in plan.holds], dtype=torch.int64).reshape(
            len(plan.rows), self.num_columns)

    def restores(self, admitted: list[AsyncRequest]) -> torch.Tensor | None:
        """[h, 2] (checkpoint slot, s_0) for each admitted request with a hit, or None."""
        pairs = []
        for req in admitted:
            if req.restore_slot is not None:
                pairs.append((req.restore_slot, req.state_slots[0]))
                req.restore_slot = None
        return torch.tensor(pairs, dtype=torch.int64) if pairs else None

    def hold(self, row) -> RowHold:
        """Slots for the boundaries ``row`` may reach. A prefill chunk's end is known exactly; a verify
        row's first position is at least the request's committed tokens - 1 and its kept tokens end at
        most at the host's optimistic count plus its query (contract 4: an upper bound)."""
        req, q, bs = row.request, row.num_tokens, self.block_size
        if req.is_prefilling:
            start = req.num_computed_tokens
            count = 1 if (start + q) % bs == 0 else 0
        else:
            start = None
            lo, hi = req.num_tokens - 1, req.num_computed_tokens + q
            count = min(self.num_columns, hi // bs - lo // bs)
        checkpoints = self.prefix.checkpoints
        slots = [checkpoints.hold() for _ in range(count)]
        slots = [self.sink_slot if s is None else s for s in slots]
        slots += [self.sink_slot] * (self.num_columns - len(slots))
        return RowHold(req, req.num_preemptions, req.is_prefilling, start, slots)

    # ---- processing -------------------------------------------------------------------------
    def settle(self, plan, tokens: list[list[int]], discarded: set[int]) -> list[Span]:
        """Before a processed step's tokens are committed: the committed span of every row that may publish.

        A row whose request finished or was preempted since planning publishes nothing (its blocks
        may belong to another request by now). A verify row started at the request's committed tokens
        - 1 (the last sampled token is never computed yet) and kept ``len(tokens[i])``.
        """
        spans = []
        pool = self.prefix.kv_pool
        for i, (row, hold) in enumerate(zip(plan.rows, plan.holds)):
            req = row.request
            if i in discarded or req.status is not RequestStatus.RUNNING \
                    or req.num_preemptions != hold.num_preemptions:
                continue
            start = hold.start if hold.is_prefill else req.num_tokens - 1
            kept = row.num_tokens if hold.is_prefill else len(tokens[i])
            pool.take(req.block_ids)
            spans.append(Span(hold, list(req.block_ids), start, start + kept, row.num_tokens))
        return spans

    def publish(self, plan, spans: list[Span]) -> None:
        """After the commit: publish each span's blocks and key the slots of the boundaries it reached."""
        held = self._held.get(plan.index, set())
        for span in spans:
            req = span.hold.request
            limit = span.start if req.is_finished and self.drafter_kv else span.limit
            keys = self.prefix.publish_blocks(req, span.blocks, span.start, limit)
            for p, slot in enumerate(span.hold.slots):
                boundary = self.boundary(span, p)
                if slot in held and boundary in keys:
                    held.remove(slot)
                    self.prefix.checkpoints.keep(slot, keys[boundary])

    def boundary(self, span: Span, p: int) -> int | None:
        """The boundary whose state entry p of the row's slots received (``AsyncRunner.checkpoint``)."""
        bs = self.block_size
        if span.hold.is_prefill:
            end = span.start + span.num_tokens
            return end if p == 0 and end % bs == 0 else None
        return (span.start // bs + 1 + p) * bs

    def done(self, plan, spans: list[Span]) -> None:
        """Whatever happened to the commit: drop the spans' references and free the slots not keyed."""
        for span in spans:
            self.prefix.kv_pool.free(span.blocks)
        self._release(self._held.pop(plan.index, set()))

    def reset(self) -> None:
        """After a fault, once the device timeline drained: free every slot of the plans never processed."""
        for index in list(self._held):
            self._release(self._held.pop(index))

    def _release(self, slots) -> None:
        for slot in slots:
            self.prefix.checkpoints.release(slot)
