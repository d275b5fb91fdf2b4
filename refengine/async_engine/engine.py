"""The async engine: schedule step N+1 while step N runs; process step N's output one step late.

The host scheduler works on optimistic request state: every scheduled draft is assumed accepted
(placeholder tokens on the host). The device holds the authoritative state, corrects it from the
verifier's output and prepares the next step's inputs itself, so nothing optimistic ever feeds a
position, slot mapping or state offset. Work scheduled for a request that turns out to have
finished is discarded when its output arrives.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from refengine.async_engine.batch import PersistentBatch
from refengine.async_engine.drafting import DeviceDrafter
from refengine.async_engine.graphs import GraphDispatcher
from refengine.async_engine.metadata import MetadataBuilder
from refengine.async_engine.records import build_records
from refengine.async_engine.runner import Admission, AsyncRunner, StepFuture, StepPlan
from refengine.async_engine.state import DeviceState, RequestSlots
from refengine.async_engine.stream import HostBuffer, Stream
from refengine.drafter import ScriptedDrafter
from refengine.engine import LLMEngine
from refengine.outputs import RequestOutput, StepRecord
from refengine.request import Request, RequestStatus
from refengine.scheduler import Scheduler, SchedulerOutput


def _backup_token(req: Request, num_tokens: int) -> int:
    """The token after a row's last position when it is a prompt token the host knows (else -1).

    A prompt chunk that does not reach the end of the prompt samples nothing; the drafter pairs its
    last position with this next prompt token instead.
    """
    nxt = req.num_computed_tokens + num_tokens
    known = len(req.prompt_token_ids) + len(req.output_token_ids)
    return req.all_token_ids[nxt] if nxt < known else -1


@dataclass(eq=False)
class AsyncRequest(Request):
    idx: int = -1  # request slot of the persistent device state; -1 while not running
    num_output_placeholders: int = 0  # optimistic tokens scheduled but not yet confirmed
    num_staged_blocks: int = 0  # block ids the device table already has

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders


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


class _AsyncScheduler(Scheduler):
    def __init__(self, config, on_release):
        super().__init__(config)
        self._on_release = on_release

    def _release(self, req):
        super()._release(req)
        self._on_release(req)

    def _preempt(self, req):
        super()._preempt(req)
        req.num_output_placeholders = 0


class AsyncLLMEngine(LLMEngine):
    def __init__(self, config, model, model_config, tokenizer=None, *, delay: bool = False,
                 hazard_check: bool = False):
        self.stream = Stream(torch.device(config.device), delay=delay, hazard_check=hazard_check)
        self._finalizer = weakref.finalize(self, self.stream.close)
        super().__init__(config, model, model_config, tokenizer)
        self.scheduler = _AsyncScheduler(config, self._on_release)
        self.batch = PersistentBatch(config.speculative.num_speculative_tokens)
        self.stats = AsyncStats()
        self._inflight: StepFuture | None = None
        self._plans = 0

    def _make_runner(self):
        c, k = self.config, self.config.speculative.num_speculative_tokens
        width = c.scheduler.max_model_len + 2 * k + 1
        self.state = DeviceState(c.scheduler.max_num_seqs, width, c.blocks_per_request, k, self.stream.device,
                                 truth_len=width if isinstance(self.drafter, ScriptedDrafter) else 0)
        self.slots = RequestSlots(c.scheduler.max_num_seqs)
        self.builder = MetadataBuilder(self.state, k, self.stream.device)
        self.graphs = GraphDispatcher(c.graph_mode, c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens, k)
        drafter = None
        if k:
            kind = "mtp" if self.drafter == "mtp" else "scripted"
            drafter = DeviceDrafter(self.model, self.caches, self.state, k, c.cache.block_size,
                                    self.model_config.vocab_size, kind, check_inputs=self.stream.hazard_check)
        return AsyncRunner(self.model, self.caches, self.state, self.stream, self.builder, drafter,
                           block_size=c.cache.block_size, num_spec_tokens=k,
                           gdn_prefill_chunked=c.gdn_prefill_chunked)

    def _new_request(self, request_id, ids, params) -> Request:
        return AsyncRequest(request_id, ids, params, self._arrivals)

    def _on_release(self, req: AsyncRequest) -> None:
        # Safe while a step that uses these resources is in flight: device work runs in order, so
        # a new owner's writes land after it.
        self.batch.remove(req)
        if req.idx >= 0:
            self.slots.free(req.idx)
            req.idx = -1
        req.num_staged_blocks = 0

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def close(self) -> None:
        self._finalizer()

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        future = self.runner.enqueue(self._plan(sched)) if sched.rows else None
        finished = self._process(self._inflight) if self._inflight is not None else []
        self._inflight = future
        if future is not None and not self.scheduler.has_unfinished():
            # Only work for requests that have finished is left in flight: settle it now.
            self._inflight = None
            finished += self._process(future)
        if future is None and not finished and self.scheduler.has_unfinished():
            raise RuntimeError("scheduler made no progress: the KV pool cannot hold any waiting request")
        self.stats.elapsed += time.perf_counter() - start
        return [self._output(r) for r in finished]

    def is_decode(self, req: Request, num_tokens: int) -> bool:
        """DESIGN §4.2: a decode row belongs to a request past its prompt; never judged by query length."""
        return not req.is_prefilling

    def host_buffer(self, name: str, rows: int, cols: int) -> HostBuffer:
        """A fresh staging buffer for each step, so none is rewritten while its copy may be pending."""
        return HostBuffer(name, self.stream, (max(rows, 1), cols), torch.int64)

    def _plan(self, sched: SchedulerOutput) -> StepPlan:
        k = self.config.speculative.num_speculative_tokens
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
        decode = [self.is_decode(r.request, r.num_tokens) for r in ordered]
        rows = [r for r, d in zip(ordered, decode) if d] + [r for r, d in zip(ordered, decode) if not d]
        num_decode = sum(decode)
        qsl = [0]
        tmeta, dmeta = [], []
        for i, row in enumerate(rows):
            req = row.request
            qsl.append(qsl[-1] + row.num_tokens)
            tmeta.append([req.idx, row.num_tokens, int(i < num_decode), int(req.has_initial_state),
                          int(row.samples), len(row.draft_token_ids)])
            dmeta.append([int(row.samples), len(row.draft_token_ids), _backup_token(req, row.num_tokens)])
        shape = self.graphs.dispatch([r.num_tokens for r in rows], [i < num_decode for i in range(len(rows))])
        target = self.host_buffer("target-inputs", len(rows), 6)
        target.write(tmeta)
        drafter = self.host_buffer("drafter-inputs", len(rows), 3)
        drafter.write(dmeta)
        plan = StepPlan(self._plans, rows, shape, num_decode, qsl, target, drafter, [r.samples for r in rows],
                        [list(r.request.state_slots) for r in rows], [r.request.num_computed_tokens for r in rows],
                        [self.batch.num_accepted_cpu[self.batch.row_of(r.request)] for r in rows],
                        record=bool(self.observers))
        self._plans += 1
        plan.admission = self._admission(admitted)
        self._stage_blocks(plan)
        for row, samples in zip(rows, plan.samples):  # optimistic: every draft accepted
            req = row.request
            if samples:
                req.num_output_placeholders += 1 + len(row.draft_token_ids)
                req.draft_token_ids = [-1] * k
            req.num_computed_tokens += row.num_tokens
        self.stats.graph_steps[shape.mode] = self.stats.graph_steps.get(shape.mode, 0) + 1
        return plan

    def _admission(self, admitted: list[AsyncRequest]) -> Admission | None:
        if not admitted:
            return None
        width = self.state.token_ids.shape[1]
        rows = torch.full((len(admitted), width), -1, dtype=torch.int64)
        for i, req in enumerate(admitted):
            ids = req.prompt_token_ids + req.output_token_ids
            rows[i, : len(ids)] = torch.tensor(ids)
        adm = Admission(
            idx=torch.tensor([r.idx for r in admitted]), token_rows=rows,
            num_tokens=torch.tensor([len(r.prompt_token_ids) + len(r.output_token_ids) for r in admitted],
                                    dtype=torch.int32),
            num_prompt=torch.tensor([len(r.prompt_token_ids) for r in admitted], dtype=torch.int32),
            slots=torch.tensor([r.state_slots for r in admitted], dtype=torch.int32))
        if isinstance(self.drafter, ScriptedDrafter):
            lt = self.state.truth.shape[1]
            adm.truth = torch.zeros(len(admitted), lt, dtype=torch.int64)
            adm.num_correct = torch.zeros(len(admitted), lt, dtype=torch.int32)
            for i, req in enumerate(admitted):
                truth = self.drafter.truth[req.request_id][:lt]
                adm.truth[i, : len(truth)] = torch.tensor(truth, dtype=torch.int64)
                adm.num_correct[i] = torch.tensor([self.drafter.num_correct(req.request_id, j) for j in range(lt)])
        return adm

    def _stage_blocks(self, plan: StepPlan) -> None:
        grown = [r.request for r in plan.rows if len(r.request.block_ids) != r.request.num_staged_blocks]
        if not grown:
            return
        table = torch.zeros(len(grown), self.state.block_table.shape[1], dtype=torch.int32)
        for i, req in enumerate(grown):
            table[i, : len(req.block_ids)] = torch.tensor(req.block_ids, dtype=torch.int32)
            req.num_staged_blocks = len(req.block_ids)
        plan.block_idx = torch.tensor([r.idx for r in grown])
        plan.block_rows = table

    def _process(self, fut: StepFuture) -> list[Request]:
        plan = fut.plan
        tokens, payload = fut.result()
        self.stats.steps += 1
        finished = []
        k = self.config.speculative.num_speculative_tokens
        discarded = {i for i, row in enumerate(plan.rows) if row.request.is_finished}
        for i, row in enumerate(plan.rows):
            req = row.request
            if i in discarded:
                self.stats.wasted_tokens += row.num_tokens
                continue
            if not plan.samples[i]:
                continue
            valid, drafted = tokens[i], len(row.draft_token_ids)
            if req.status is RequestStatus.RUNNING:  # a preempted request restarts from its tokens anyway
                req.num_output_placeholders -= 1 + drafted
                req.num_computed_tokens -= drafted - (len(valid) - 1)
            if i < plan.num_decode and k:
                self._count_acceptance(req, drafted, len(valid) - 1)
            self.batch.set_accepted(req, len(valid))
            self.stats.tokens += len(valid)
            if self._append(req, valid):
                finished.append(req)
        if plan.record:
            rows = [r for i, r in enumerate(build_records(plan, tokens, payload, k)) if i not in discarded]
            record = StepRecord(plan.index, rows, [], plan.shape.mode,
                                plan.shape.num_reqs_padded, payload.get("gdn_shapes", {}))
            for fn in self.observers:
                fn(record)
        return finished

    def _count_acceptance(self, req: Request, drafted: int, accepted: int) -> None:
        req.num_verify_steps += 1
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += accepted
        req.acceptance.append((drafted, accepted))
        s = self.stats
        while len(s.drafted_per_position) < drafted:
            s.drafted_per_position.append(0)
            s.accepted_per_position.append(0)
        for j in range(drafted):
            s.drafted_per_position[j] += 1
            s.accepted_per_position[j] += int(j < accepted)

    def pools_empty(self) -> bool:
        return super().pools_empty() and self._inflight is None
