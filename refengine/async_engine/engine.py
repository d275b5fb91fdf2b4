"""The async engine: schedule step N+1 while step N runs; process step N's output one step late.

The host scheduler works on optimistic request state (``optimistic.py``): every scheduled draft
is assumed accepted. The device holds the authoritative state, corrects it from the verifier's
output and prepares the next step's inputs itself, so nothing optimistic ever feeds a position,
slot mapping or state offset. Work scheduled for a request that turns out to have finished is
discarded when its output arrives.

A step: plan (schedule, place rows, stage host inputs) -> enqueue on the device -> process the
previous step's output (commit tokens through the core, notify observers).

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
from refengine.async_engine.graphs import GraphDispatcher
from refengine.async_engine.inputs import StagedWrites, StepRows
from refengine.async_engine.metadata import MetadataBuilder
from refengine.async_engine.optimistic import (
    AsyncRequest,
    assume_accepted,
    forget,
    scheduled_num_tokens,
    settle,
)
from refengine.async_engine.prefix import AsyncPrefixCache
from refengine.async_engine.records import build_records
from refengine.async_engine.runner import AsyncRunner, StepFuture, StepPlan
from refengine.async_engine.state import DeviceState, RequestSlots
from refengine.async_engine.stream import DeviceWorkError, HostBuffer, Stream
from refengine.cache import ModelCaches
from refengine.config import EngineConfig, torch_dtype
from refengine.core import EngineCore
from refengine.drafters import DeviceDraftContext, make_drafter
from refengine.engine import Engine
from refengine.outputs import StepRecord
from refengine.request import Request
from refengine.scheduler import ScheduledRow, SchedulerOutput


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

    def host_seconds_per_step(self, waited: float) -> float:
        """Host time per step not spent blocked on the device (``waited``: the stream's wait total)."""
        return (self.elapsed - waited) / self.steps if self.steps else 0.0

    def count_acceptance(self, drafted: int, accepted: int) -> None:
        while len(self.drafted_per_position) < drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for j in range(drafted):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += int(j < accepted)


def backup_token(req: Request, num_tokens: int) -> int:
    """The token after a row's last position when it is a prompt token the host knows (else -1).

    A prompt chunk that does not reach the end of the prompt samples nothing; the drafter pairs its
    last position with this next prompt token instead.
    """
    nxt = req.num_computed_tokens + num_tokens
    known = len(req.prompt_token_ids) + len(req.output_token_ids)
    return req.all_token_ids[nxt] if nxt < known else -1


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
                               on_preempt=forget, drafter_kv_cache=drafter_kv)
        # With prefix caching: the per-request slots, the checkpoints, the staging slots, then a sink slot
        # that the copies nobody asked for go to.
        caching = c.cache.enable_prefix_caching
        num_slots = c.num_state_slots + c.num_state_checkpoints + c.num_staged_checkpoints + int(caching)
        sink_checkpoint = num_slots - 1 if caching else None
        self.prefix = AsyncPrefixCache(self.core.scheduler.prefix, c.num_checkpoint_columns,
                                       sink_checkpoint) if caching else None
        self.caches = ModelCaches(model_config, c.num_kv_blocks, c.cache.block_size, num_slots, k,
                                  torch_dtype(c.dtype), c.device, drafter_kv=drafter_kv)
        device = self.stream.device
        self.state = DeviceState(c.scheduler.max_num_seqs, c.scheduler.max_model_len + 2 * k + 1,
                                 c.blocks_per_request, k, self.caches.sink_block, device)
        self.slots = RequestSlots(c.scheduler.max_num_seqs)
        self.batch = PersistentBatch(k)
        self.graphs = GraphDispatcher(
            c.graph_mode, c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens, k
        )
        self.builder = MetadataBuilder(self.state, k, device)
        proposer = None if self.drafter is None else self.drafter.device_proposer(DeviceDraftContext(
            model, self.caches, self.state, k, c.cache.block_size, model_config.vocab_size, device,
            check_inputs=hazard_check))
        self.runner = AsyncRunner(model, self.caches, self.state, self.stream, self.builder, proposer,
                                  block_size=c.cache.block_size, num_speculative_tokens=k,
                                  recurrent_prefill_chunked=c.recurrent_prefill_chunked,
                                  vocab_size=model_config.vocab_size, check_inputs=hazard_check,
                                  sink_checkpoint=sink_checkpoint,
                                  num_checkpoint_columns=c.num_checkpoint_columns if caching else 0)
        self.stats = AsyncStats()
        self._inflight: StepFuture | None = None
        self._plans = 0

    def _on_release(self, req: AsyncRequest) -> None:
        # Safe while a step that uses these resources is in flight: device work runs in order, so
        # a new owner's writes land after it.
        self.batch.remove(req)
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
            future = self.runner.enqueue(self.plan(sched)) if sched.rows else None
            previous, self._inflight = self._inflight, future
            finished = self.process(previous) if previous is not None else []
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

    def place(self, sched: SchedulerOutput) -> tuple[list[ScheduledRow], int, list[AsyncRequest]]:
        """Place the scheduled rows in the persistent batch: (rows, decode rows, admitted requests).

        Rows come decode rows first. A decode row belongs to a request past its prompt (contract 2):
        never judged by query length.
        """
        admitted = [row.request for row in sched.rows if row.request.idx < 0]
        for req in admitted:
            req.idx = self.slots.allocate()
            self.batch.add(req)
        moves = self.batch.num_moves
        self.batch.condense()
        self.batch.reorder()
        self.stats.row_moves += self.batch.num_moves - moves
        by_req = {id(r.request): r for r in sched.rows}
        ordered = [by_req[id(q)] for q in self.batch.order(set(by_req))]
        decode = [r for r in ordered if not r.request.is_prefilling]
        return decode + [r for r in ordered if r.request.is_prefilling], len(decode), admitted

    def plan(self, sched: SchedulerOutput) -> StepPlan:
        """Place the scheduled rows and stage the step's host inputs: the row table and the writes to
        persistent state (admissions, block-table growth, restores)."""
        rows, num_decode, admitted = self.place(sched)
        qsl = [0]
        for row in rows:
            qsl.append(qsl[-1] + row.num_tokens)
        shape = self.graphs.dispatch([r.num_tokens for r in rows], [i < num_decode for i in range(len(rows))],
                                     [len(r.draft_token_ids) for r in rows])
        # before the optimistic assumptions below: prefix caching holds slots for what each row may reach
        prefix_rows = self.prefix.stage(self._plans, rows) if self.prefix is not None else []
        width = self.prefix.num_columns if self.prefix is not None else 0
        inputs = HostBuffer("step-inputs", self.stream, (len(rows), StepRows.width(width)), torch.int64)
        inputs.write(
            StepRows.pack(
                [
                    {
                        "idx": r.request.idx,
                        "query_len": r.num_tokens,
                        "is_decode": i < num_decode,
                        "has_initial_state": r.request.has_initial_state,
                        "is_sampling": r.samples,
                        "num_draft_positions": len(r.draft_token_ids),
                        "backup_token": backup_token(r.request, r.num_tokens),
                        "checkpoint_slots": prefix_rows[i].held if prefix_rows else [],
                    }
                    for i, r in enumerate(rows)
                ]
            )
        )
        proposer = self.runner.proposer
        plan = StepPlan(
            self._plans,
            rows,
            shape,
            num_decode,
            qsl,
            inputs,
            [list(r.request.state_slots) for r in rows],
            list(sched.preempted),
            list(sched.resumed),
            record=bool(self.core.observers),
            writes=self._writes(sched, rows, admitted),
            drafter_admission=proposer.stage(admitted) if proposer is not None and admitted else None,
            prefix_rows=prefix_rows,
        )
        self._plans += 1
        for row in rows:
            assume_accepted(row, self.config.speculative.num_speculative_tokens)
        mode = shape.mode.value
        self.stats.graph_steps[mode] = self.stats.graph_steps.get(mode, 0) + 1
        return plan

    def _writes(self, sched: SchedulerOutput, rows: list[ScheduledRow],
                admitted: list[AsyncRequest]) -> StagedWrites:
        """The step's writes to persistent state: admitted rows, grown block-table rows, restores of hits."""
        w = StagedWrites()
        if admitted:
            width = self.state.token_ids.shape[1]
            tokens = torch.full((len(admitted), width), -1, dtype=torch.int64)
            for i, req in enumerate(admitted):
                ids = req.prompt_token_ids + req.output_token_ids
                tokens[i, : len(ids)] = torch.tensor(ids)
            i32 = {"dtype": torch.int32}
            w.add("admit.idx", torch.tensor([r.idx for r in admitted]))  # [n] request slots
            w.add("admit.token_rows", tokens)  # [n, L] committed tokens, then -1
            w.add("admit.num_tokens", torch.tensor([r.num_tokens for r in admitted], **i32))  # [n]
            w.add("admit.num_prompt", torch.tensor([len(r.prompt_token_ids) for r in admitted], **i32))  # [n]
            w.add("admit.slots", torch.tensor([r.state_slots for r in admitted], **i32))  # [n, K+1]
            # [n] tokens a prefix-cache hit serves (0 without one)
            w.add("admit.num_computed", torch.tensor([r.num_computed_tokens for r in admitted], **i32))
        grown = [r.request for r in rows if len(r.request.block_ids) != r.request.num_staged_blocks]
        if grown:
            table = torch.full((len(grown), self.state.block_table.shape[1]), self.state.sink_block,
                               dtype=torch.int32)
            for i, req in enumerate(grown):
                table[i, : len(req.block_ids)] = torch.tensor(req.block_ids, dtype=torch.int32)
                req.num_staged_blocks = len(req.block_ids)
            w.add("blocks.idx", torch.tensor([r.idx for r in grown]))  # [m] request slots
            w.add("blocks.rows", table)  # [m, B] block ids, the sink block past the request's own
        if sched.restores:  # [h, 2] (checkpoint slot, s_0) per request admitted on a hit
            w.add("restores", torch.tensor([(r.checkpoint, r.slot) for r in sched.restores]))
        return w

    def process(self, fut: StepFuture) -> list[Request]:
        """Commit a finished step's tokens through the core; the requests it finished are returned."""
        plan = fut.plan
        tokens, drafted = fut.result()  # drafted: the device's draft count per row (the host scheduled K)
        self.stats.steps += 1
        discarded = {i for i, row in enumerate(plan.rows) if row.request.is_finished}
        cache = self.core.scheduler.prefix
        spans = self.prefix.spans(plan, tokens, discarded) if self.prefix is not None else []
        if cache is not None:
            cache.hold(spans)
        try:
            finished = self._commit(plan, tokens, drafted, discarded)
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

    def _commit(self, plan: StepPlan, tokens: list[list[int]], drafted: list[int],
                discarded: set[int]) -> list[Request]:
        """Commit the kept tokens of every row not discarded; the requests that finished are returned."""
        finished = []
        for i, row in enumerate(plan.rows):
            req = row.request
            if i in discarded:
                self.stats.wasted_tokens += row.num_tokens
                continue
            if not row.samples:
                continue
            valid = tokens[i]
            settle(req, row, valid)
            num_drafts = drafted[i] if i < plan.num_decode else None
            if num_drafts is not None:
                self.stats.count_acceptance(num_drafts, len(valid) - 1)
            self.stats.tokens += len(valid)
            if self.core.commit(req, valid, num_drafts=num_drafts):
                finished.append(req)
        self.core.finished(finished)
        return finished
