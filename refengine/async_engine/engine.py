"""The async engine: schedule step N+1 while step N runs; process step N's output one step late.

The host scheduler works on optimistic request state (``optimistic.py``): every scheduled draft
is assumed accepted. The device holds the authoritative state, corrects it from the verifier's
output and prepares the next step's inputs itself, so nothing optimistic ever feeds a position,
slot mapping or state offset. Work scheduled for a request that turns out to have finished is
discarded when its output arrives.

A step: schedule -> plan (``planner.py``: place rows, stage host inputs) -> enqueue on the device ->
process the previous step's output (the post-step writer, ``refengine.postprocess``, commits its
tokens; observers get its records).

With prefix caching (``prefix.py``) planning also stages the restores of hits and holds checkpoint
slots for the boundaries a step may reach; processing runs the prefix cache's step protocol (hold,
publish, release) on what the verifier actually kept.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from refengine.async_engine.batch import PersistentBatch
from refengine.async_engine.grammar import GrammarSlots
from refengine.async_engine.graphs import GraphDispatcher
from refengine.async_engine.metadata import MetadataBuilder
from refengine.async_engine.optimistic import AsyncRequest, forget, scheduled_num_tokens, settle
from refengine.async_engine.planner import StepPlanner
from refengine.async_engine.prefix import AsyncPrefixCache
from refengine.async_engine.records import build_records
from refengine.async_engine.runner import AsyncRunner, StepFuture
from refengine.async_engine.state import DeviceState, RequestSlots
from refengine.async_engine.stream import DeviceWorkError, Stream
from refengine.cache import ModelCaches
from refengine.config import EngineConfig, torch_dtype
from refengine.core import EngineCore
from refengine.drafters import DeviceDraftContext, drafter_cache_specs, make_drafter
from refengine.engine import Engine
from refengine.outputs import StepRecord
from refengine.postprocess import RowOutcome, postprocess
from refengine.request import Request


@dataclass
class AsyncStats:
    steps: int = 0
    tokens: int = 0  # confirmed output tokens
    wasted_tokens: int = 0  # scheduled tokens of requests that had already finished
    row_moves: int = 0
    graph_steps: dict = field(default_factory=dict)  # runtime graph mode -> steps
    accepted_per_position: list = field(default_factory=list)  # position j -> drafts accepted there
    drafted_per_position: list = field(default_factory=list)
    elapsed: float = 0.0

    def syncs_per_step(self, waits: int) -> float:
        return waits / self.steps if self.steps else 0.0

    def count_acceptance(self, drafted: int, accepted: int) -> None:
        while len(self.drafted_per_position) < drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for j in range(drafted):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += int(j < accepted)


class AsyncEngine(Engine):
    def __init__(self, config: EngineConfig, model, model_config, tokenizer=None, *, delay: bool = False,
                 hazard_check: bool = False):
        c, k = config, config.speculative.num_speculative_tokens
        self.config = config
        self.model = model
        self.stream = Stream(torch.device(c.device), delay=delay, hazard_check=hazard_check)
        self._finalizer = weakref.finalize(self, self.stream.close)
        self.drafter = make_drafter(c.speculative, model_config.vocab_size, c.scheduler.max_model_len)
        if self.drafter is not None:
            self.drafter.check_model(model)
        drafter_kv = self.drafter is not None and self.drafter.uses_kv_cache
        self.core = EngineCore(c, model_config, tokenizer, request_type=AsyncRequest,
                               num_tokens=scheduled_num_tokens, on_release=self._on_release,
                               on_preempt=forget, drafter_kv_cache=drafter_kv,
                               drop_last_block=getattr(self.drafter, "drops_last_block", False))
        # With prefix caching: the per-request slots, the checkpoints, the staging slots, then a sink slot
        # that the copies nobody asked for go to.
        caching = c.cache.enable_prefix_caching
        num_slots = c.num_state_slots + c.num_state_checkpoints + c.num_staged_checkpoints + int(caching)
        sink_checkpoint = num_slots - 1 if caching else None
        self.prefix = AsyncPrefixCache(self.core.scheduler.prefix, c.num_checkpoint_columns,
                                       sink_checkpoint) if caching else None
        self.caches = ModelCaches(model_config, c.num_kv_blocks, c.cache.block_size, num_slots, k,
                                  torch_dtype(c.dtype), c.device, drafter_kv=drafter_kv,
                                  drafter_specs=drafter_cache_specs(self.drafter, model_config, k))
        device = self.stream.device
        self.state = DeviceState(c.scheduler.max_num_seqs, c.scheduler.max_model_len + 2 * k + 1,
                                 c.blocks_per_request, k, self.caches.sink_block, device,
                                 vocab_size=model_config.vocab_size)
        self.slots = RequestSlots(c.scheduler.max_num_seqs)
        self.batch = PersistentBatch(k)
        self.graphs = GraphDispatcher(
            c.graph_mode, c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens, k
        )
        self.builder = MetadataBuilder(self.state, k, device)
        max_rows = max(self.graphs.request_sizes + [c.scheduler.max_num_seqs])  # a step's most padded rows
        proposer = None if self.drafter is None else self.drafter.device_proposer(DeviceDraftContext(
            model, self.caches, self.state, k, c.cache.block_size, model_config.vocab_size, device,
            check_inputs=hazard_check))
        self.runner = AsyncRunner(model, self.caches, self.state, self.stream, self.builder, proposer,
                                  block_size=c.cache.block_size, num_speculative_tokens=k,
                                  recurrent_prefill_chunked=c.recurrent_prefill_chunked,
                                  vocab_size=model_config.vocab_size, check_inputs=hazard_check,
                                  sink_checkpoint=sink_checkpoint,
                                  num_checkpoint_columns=c.num_checkpoint_columns if caching else 0,
                                  max_rows=max_rows)
        self.stats = AsyncStats()
        self.grammars = GrammarSlots(self.core, c.scheduler.max_num_seqs, k, model_config.vocab_size,
                                     self.stream)
        self.planner = StepPlanner(
            slots=self.slots, batch=self.batch, graphs=self.graphs, state=self.state, stream=self.stream,
            prefix=self.prefix, proposer=proposer, stats=self.stats, num_speculative_tokens=k,
            observed=lambda: bool(self.core.observers), grammars=self.grammars, max_rows=max_rows)
        self._inflight: StepFuture | None = None

    def _on_release(self, req: AsyncRequest) -> None:
        # Safe while a step that uses these resources is in flight: device work runs in order, so
        # a new owner's writes land after it.
        self.batch.remove(req)
        self.grammars.release(req)
        if req.idx >= 0:
            self.slots.free(req.idx)
            req.idx = -1
        req.num_staged_blocks = 0

    def close(self) -> None:
        self._finalizer()

    # ---- one step: plan -> enqueue -> process the previous step ---------------------------------
    def _step(self) -> bool:
        start = time.perf_counter()
        try:
            scheduler = self.core.scheduler
            sched = scheduler.schedule()
            future = self.runner.enqueue(self.planner.plan(sched)) if sched.rows else None
            previous, self._inflight = self._inflight, future
            finished = self.process(previous) if previous is not None else []
            if future is not None and future.event is None:  # run in parts: the grammars are now current
                self.runner.complete(future, self.grammars.bitmask(future.plan))
            if future is not None and not scheduler.has_unfinished():
                # Only work for requests that have finished is left in flight: settle it now.
                self._inflight = None
                finished += self.process(future)
            return future is not None or bool(finished)
        finally:
            self.stats.elapsed += time.perf_counter() - start

    def _in_flight(self) -> bool:
        return self._inflight is not None

    def _request_slots(self) -> tuple[int, int]:
        free = self.slots.num_free
        return self.config.scheduler.max_num_seqs - free, free

    def _reset(self) -> None:
        """After a fault: let the device timeline drain, and forget what was in flight (not committed)."""
        self._inflight = None
        for _ in range(3):  # a failed device program reports once, then the timeline drains
            try:
                self.stream.synchronize()
                break
            except DeviceWorkError:
                continue
        else:
            raise RuntimeError("the device timeline did not drain after the fault")
        if self.prefix is not None:
            self.prefix.reset()

    def process(self, fut: StepFuture) -> list[Request]:
        """Commit a finished step's tokens through the core; the requests it finished are returned."""
        plan = fut.plan
        tokens, drafted = fut.result()  # drafted: the device's draft count per row (the host scheduled K)
        self.grammars.note_drafts(plan, fut)
        self.stats.steps += 1
        discarded = {i for i, row in enumerate(plan.rows) if row.request.is_finished}
        cache = self.core.scheduler.prefix
        spans = self.prefix.spans(plan, tokens, discarded) if self.prefix is not None else []
        if cache is not None:
            cache.hold(spans)
        try:
            finished = self._commit(fut, tokens, drafted, discarded)
            if cache is not None:
                self.prefix.keep(plan.index, cache.publish(spans))
        finally:
            if cache is not None:
                cache.release(spans)
                self.prefix.unstage(plan.index)
        if plan.record:
            self._record(fut, tokens, drafted, discarded)
        return finished

    def _record(
        self, fut: StepFuture, tokens: list[list[int]], drafted: list[int], discarded: set[int]
    ) -> None:
        plan, k = fut.plan, self.config.speculative.num_speculative_tokens
        rows = [
            r
            for i, r in enumerate(build_records(plan, tokens, drafted, fut.payload, k))
            if i not in discarded
        ]
        self.core.record(StepRecord(plan.index, rows, plan.preempted, plan.shape.mode.value,
                                    plan.shape.num_reqs_padded, fut.payload.metadata_shapes, plan.resumed))

    def _commit(self, fut: StepFuture, tokens: list[list[int]], drafted: list[int],
                discarded: set[int]) -> list[Request]:
        """Commit the kept tokens of every row not discarded; the requests that finished are returned."""
        plan, outcomes = fut.plan, []
        for i, row in enumerate(plan.rows):
            if i in discarded:
                self.stats.wasted_tokens += row.num_tokens
                continue
            plp = fut.row_prompt_logprobs(i) if fut.prompt_logprobs is not None else None
            if not row.samples:
                outcomes.append(RowOutcome(row, None, None, prompt_logprobs=plp))
                continue
            num_drafts = drafted[i] if i < plan.num_decode else None
            if num_drafts is not None:
                self.stats.count_acceptance(num_drafts, len(tokens[i]) - 1)
            self.stats.tokens += len(tokens[i])
            lp = fut.row_logprobs(i, len(tokens[i])) if row.request.params.logprobs is not None else None
            outcomes.append(RowOutcome(row, tokens[i], num_drafts, lp, plp))
        finished, _ = postprocess(self.core, outcomes, undo=settle)
        return finished
