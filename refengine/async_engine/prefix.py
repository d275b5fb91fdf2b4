"""Prefix caching in the async engine: the prefix cache's step protocol, one step late.

The scheduler (shared with the reference engine) finds hits and stops prefill chunks; a hit's KV
blocks are shared through the block table as usual, and its ``Restore`` (in the scheduler's output)
is staged with the step's other writes, so the copy into s_0 runs on the device timeline before the
request's first program. What differs from the reference engine is when the host knows things:

- The host plans step N+1 before it knows how many of step N's drafts the verifier kept, so it knows
  neither which block boundary a verify row will reach nor that block's key (it hashes tokens not
  sampled yet). At planning (``stage``) it holds checkpoint staging slots (``CheckpointPool.hold``)
  for every boundary a row may reach: one for a prefill chunk that ends on the block grid, up to P
  for a verify row whose possible positions cover boundaries. They go into the row table
  (``StepRows.checkpoint_slots``); the step program copies the state at each boundary the kept tokens
  reached into its slot (``AsyncRunner.checkpoint``, columns from ``geometry.column_table``), masked,
  so it reads nothing back.
- When step N is processed the host knows what was kept: ``spans`` gives the committed span of every
  row, and the engine runs the protocol on them (hold, commit, publish, release). Each checkpoint
  ``publish`` names is the p-th boundary of its span (``geometry.reached``), whose state the program
  copied into the slot held for p: ``keep`` keys it (``CheckpointPool.keep``, which evicts as the
  reference engine's ``reserve`` does); ``unstage`` frees the slots not keyed. Optimistic counts never
  decide what is published.
"""

from __future__ import annotations

from dataclasses import dataclass

from refengine.async_engine.optimistic import AsyncRequest
from refengine.prefix_cache import Checkpoint, PrefixCache, Span, geometry
from refengine.request import RequestStatus


@dataclass
class RowStage:
    """What planning set aside for one row of a step, for when the step is processed."""

    request: AsyncRequest
    num_preemptions: int  # the request's preemptions at planning: one since then released its blocks
    is_prefill: bool
    start: int | None  # prefill rows: committed tokens before the chunk (exact at planning); else None
    held: list[int]  # P checkpoint slots, entry p for the row's p-th boundary; the sink slot where none


class AsyncPrefixCache:
    def __init__(self, prefix: PrefixCache, num_columns: int, sink_checkpoint: int):
        self.prefix = prefix
        self.block_size = prefix.block_size
        self.num_columns = num_columns  # P: boundaries one row's step can reach
        self.sink_checkpoint = sink_checkpoint
        self._held: dict[int, set[int]] = {}  # plan index -> slots it still holds

    # ---- planning ---------------------------------------------------------------------------
    def stage(self, index: int, rows) -> list[RowStage]:
        """Hold the checkpoint slots of every row of plan ``index`` (before its optimistic assumptions)."""
        stages = [self._stage_row(row) for row in rows]
        self._held[index] = {s for st in stages for s in st.held if s != self.sink_checkpoint}
        return stages

    def _stage_row(self, row) -> RowStage:
        """Slots for the boundaries ``row`` may reach. A prefill chunk's end is known exactly; a verify
        row's first position is at least the request's committed tokens - 1 and its kept tokens end at
        most at the host's optimistic count plus its query (contract 4: an upper bound)."""
        req, q, bs = row.request, row.num_tokens, self.block_size
        if req.is_prefilling:
            start = req.num_computed_tokens
            count = len(geometry.reached(start, q, q, True, bs))
        else:
            start = None
            lo, hi = req.num_tokens - 1, req.num_computed_tokens + q
            count = min(self.num_columns, geometry.num_boundaries(lo, hi, bs))
        checkpoints = self.prefix.checkpoints
        slots = [checkpoints.hold() for _ in range(count)]
        slots = [self.sink_checkpoint if s is None else s for s in slots]
        slots += [self.sink_checkpoint] * (self.num_columns - len(slots))
        return RowStage(req, req.num_preemptions, req.is_prefilling, start, slots)

    # ---- processing -------------------------------------------------------------------------
    def spans(self, plan, tokens: list[list[int]], discarded: set[int]) -> list[Span]:
        """Before a processed step's tokens are committed: the committed span of every row that may publish.

        A row whose request finished or was preempted since planning publishes nothing (its blocks
        may belong to another request by now). A verify row started at the request's committed tokens
        - 1 (the last sampled token is never computed yet) and kept ``len(tokens[i])``.
        """
        spans = []
        for i, (row, st) in enumerate(zip(plan.rows, plan.prefix_rows)):
            req = row.request
            if i in discarded or req.status is not RequestStatus.RUNNING \
                    or req.num_preemptions != st.num_preemptions:
                continue
            start = st.start if st.is_prefill else req.num_tokens - 1
            kept = row.num_tokens if st.is_prefill else len(tokens[i])
            spans.append(Span(req, start, row.num_tokens, kept, st.is_prefill, plan.slots[i], st.held))
        return spans

    def keep(self, index: int, checkpoints: list[Checkpoint]) -> None:
        """Key the slot the program copied each published checkpoint's state into."""
        held = self._held.get(index, set())
        for c in checkpoints:
            slot = c.span.held[c.index]
            if slot in held:
                held.remove(slot)
                self.prefix.checkpoints.keep(slot, c.key)

    def unstage(self, index: int) -> None:
        """Whatever happened to the commit: free plan ``index``'s slots that were not keyed."""
        self._release(self._held.pop(index, set()))

    def reset(self) -> None:
        """After a fault, once the device timeline drained: free every slot of the plans never processed."""
        for index in list(self._held):
            self._release(self._held.pop(index))

    def _release(self, slots) -> None:
        for slot in slots:
            self.prefix.checkpoints.release(slot)
