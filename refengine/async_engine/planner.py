"""Planning an async step on the host: place the scheduled rows, stage the host inputs, and the plan.

``StepPlanner.plan`` turns the scheduler's output into a ``StepPlan``: the rows placed in the persistent
batch (decode rows first), the step's padded shape, the row table (``StepRows``) in a host buffer,
the staged writes to persistent state (admissions, block-table growth, prefix-cache restores), and
what prefix caching held for each row. Then it records the optimistic assumptions the scheduler
plans the next step on (``optimistic.assume_accepted``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from refengine.async_engine.batch import PersistentBatch
from refengine.async_engine.graphs import GraphDispatcher, StepShape
from refengine.async_engine.inputs import StagedWrites, StepRows
from refengine.async_engine.optimistic import AsyncRequest, assume_accepted
from refengine.async_engine.processing import ProcessorState
from refengine.async_engine.state import DeviceState, RequestSlots
from refengine.async_engine.stream import HostBuffer, HostRing, Stream
from refengine.logits_process import prompt_logprob_span
from refengine.request import Request
from refengine.scheduler import ScheduledRow, SchedulerOutput


@dataclass
class StepPlan:
    """One planned step: host bookkeeping for processing it, and what is staged for the device (``inputs``,
    the row table, and ``writes``, the persistent-state writes before the program)."""

    index: int
    rows: list  # ScheduledRow, in batch order (decode rows first); n real rows
    shape: StepShape
    num_decode: int  # real decode rows (the first ``num_decode`` of ``rows``)
    qsl: list[int]  # [n+1] host query_start_loc of the real rows
    inputs: HostBuffer  # StepRows table: [n, F] the rows (enqueue adds a FULL step's padding rows [n:Np])
    # per row: the request's recurrent slots s_0..s_K (a snapshot, for records and prefix caching; else empty)
    slots: list[list[int]]
    preempted: list[str] = field(default_factory=list)  # for records: preempted when this step was scheduled
    resumed: list[str] = field(default_factory=list)  # for records: readmitted after a preemption
    record: bool = False  # observers want this step's payload
    writes: StagedWrites = field(default_factory=StagedWrites)  # persistent-state writes, one copy
    drafter_admission: object = None  # what the drafter's proposer staged for the admitted rows, or None
    prefix_rows: list = field(default_factory=list)  # per row: what prefix caching set aside (RowStage)
    logprobs: bool = False  # a row's request asks for logprobs: the step's logprob tables are copied back
    # prompt chunks of requests asking prompt logprobs: (row, first prompt index, count) each, and their
    # positions in the token axis and target prompt tokens ([P] host tensors); empty in a FULL step (no
    # prefill)
    prompt_logprobs: list = field(default_factory=list)
    prompt_positions: torch.Tensor | None = None
    prompt_targets: torch.Tensor | None = None
    slots_idx: list[int] = field(default_factory=list)  # per row: its request slot when planned



# the row table's one-column fields, in the order ``StepPlanner.plan`` writes them
ROW_FIELDS = ("idx", "query_len", "is_decode", "has_initial_state", "is_sampling", "num_draft_positions",
              "backup_token", "block_at0", "block_at1", "block_id0", "block_id1")
NO_BLOCKS = [-1, -1, 0, 0]  # a row's block columns when its request got no new block


def new_blocks(req) -> list[int] | None:
    """The row table's block columns for ``req`` (``StepRows.block_at0`` ...: entries, then block ids), or
    None when its blocks go through the staged writes: a new owner of the slot (its whole row is
    written) or more than two new blocks. Marks the blocks staged."""
    have, staged = len(req.block_ids), req.num_staged_blocks
    if have == staged:
        return NO_BLOCKS
    if staged == 0 or have < staged or have - staged > 2:
        return None
    req.num_staged_blocks = have
    if have - staged == 1:
        return [staged, -1, req.block_ids[staged], 0]
    return [staged, staged + 1, req.block_ids[staged], req.block_ids[staged + 1]]


def backup_token(req: Request, num_tokens: int) -> int:
    """The token after a row's last position when it is a prompt token the host knows (else -1).

    A prompt chunk that does not reach the end of the prompt samples nothing; the drafter pairs its
    last position with this next prompt token instead.
    """
    nxt = req.num_computed_tokens + num_tokens
    known = len(req.prompt_token_ids) + len(req.output_token_ids)
    return req.all_token_ids[nxt] if nxt < known else -1


class StepPlanner:
    """Builds each step's ``StepPlan`` (the host side of planning; the scheduler chose the rows)."""

    def __init__(self, *, slots: RequestSlots, batch: PersistentBatch, graphs: GraphDispatcher,
                 state: DeviceState, stream: Stream, prefix, proposer, stats, num_speculative_tokens: int,
                 observed: Callable[[], bool], grammars=None, max_rows: int = 0):
        """``prefix``: the ``AsyncPrefixCache`` or None; ``proposer``: the drafter's device proposer or None;
        ``observed``: whether observers want the step's payload; ``grammars``: the ``GrammarSlots``;
        ``max_rows``: the most padded rows of a step (the row table's buffers hold that many)."""
        self.slots = slots
        self.batch = batch
        self.graphs = graphs
        self.state = state
        self.stream = stream
        self.prefix = prefix
        self.proposer = proposer
        self.stats = stats
        self.num_speculative_tokens = num_speculative_tokens
        self.observed = observed
        self.grammars = grammars
        self.num_plans = 0
        assert StepRows.columns() == ROW_FIELDS, "plan writes the row table's columns in ROW_FIELDS order"
        width = StepRows.width(prefix.num_columns if prefix is not None else 0)
        # the row tables [R, F] and the staged writes' packed bytes (grown as needed), taken in turn
        self._tables = HostRing("step-inputs", stream, (max(max_rows, 1), width), torch.int64)
        self._writes_buffers = HostRing("staged-writes", stream, (256,), torch.int64)

    def place(self, sched: SchedulerOutput) -> tuple[list[ScheduledRow], int, list[AsyncRequest]]:
        """Place the scheduled rows in the persistent batch: (rows, decode rows, admitted requests).

        Rows come decode rows first. A decode row belongs to a request past its prompt (contract 2):
        never judged by query length.
        """
        admitted = [row.request for row in sched.rows if row.request.idx < 0]
        for req in admitted:
            req.idx = self.slots.allocate()
            self.batch.add(req)
            if self.grammars is not None:
                self.grammars.admit(req)
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
        # one pass over the rows: the row table's rows, the dispatcher's lists, the step's flags
        table, query_lens, is_decode, drafts, idx, qsl, grown = [], [], [], [], [], [0], []
        processors = logprobs = sampling = grammar = False
        for i, r in enumerate(rows):
            req, q, d = r.request, r.num_tokens, len(r.draft_token_ids)
            decode = i < num_decode
            blocks = new_blocks(req)
            if blocks is None:
                grown.append(req)
                blocks = NO_BLOCKS
            table.append([req.idx, q, decode, req.has_initial_state, r.samples, d, backup_token(req, q),
                          *blocks])
            query_lens.append(q)
            is_decode.append(decode)
            drafts.append(d)
            idx.append(req.idx)
            qsl.append(qsl[-1] + q)
            processors = processors or req.processors.active
            logprobs = logprobs or req.params.logprobs is not None
            sampling = sampling or req.params.samples
            grammar = grammar or req.compiled_grammar is not None
        shape = self.graphs.dispatch(query_lens, is_decode, drafts)
        # the program processes logits and computes logprob tables only for steps whose rows need them
        if processors or logprobs or sampling or grammar:
            shape = replace(shape, processors=processors, logprobs=logprobs, sampling=sampling,
                            grammar=grammar)
        # before the optimistic assumptions below: prefix caching holds slots for what each row may reach
        prefix_rows = self.prefix.stage(self.num_plans, rows) if self.prefix is not None else []
        for row, st in zip(table, prefix_rows):
            row += st.held
        inputs = self._tables.take(self.num_plans)
        if table:
            inputs.array[: len(table)] = table
        proposer = self.proposer
        record = self.observed()
        plan = StepPlan(
            self.num_plans,
            rows,
            shape,
            num_decode,
            qsl,
            inputs,
            [list(r.request.state_slots) for r in rows] if record or self.prefix is not None else [],
            list(sched.preempted),
            list(sched.resumed),
            record=record,
            writes=self._writes(sched, admitted, grown),
            drafter_admission=proposer.stage(admitted) if proposer is not None and admitted else None,
            prefix_rows=prefix_rows,
            logprobs=shape.logprobs,
            slots_idx=idx,
        )
        self._prompt_logprobs(plan)
        self.num_plans += 1
        for row in rows:
            assume_accepted(row, self.num_speculative_tokens)
        mode = shape.mode.value
        self.stats.graph_steps[mode] = self.stats.graph_steps.get(mode, 0) + 1
        return plan

    @staticmethod
    def _prompt_logprobs(plan: StepPlan) -> None:
        """The prompt logprobs the plan's prompt chunks yield (``logits_process.prompt_logprob_span``), known
        on the host before the step: no read back is needed to pick them."""
        positions, targets = [], []
        for i, row in enumerate(plan.rows[plan.num_decode:], plan.num_decode):
            req = row.request
            span = prompt_logprob_span(req, req.num_computed_tokens, row.num_tokens)
            if span is None:
                continue
            first, count = span
            plan.prompt_logprobs.append((i, first, count))
            positions.extend(range(plan.qsl[i], plan.qsl[i] + count))
            targets.extend(req.prompt_token_ids[first: first + count])
        if positions:
            plan.prompt_positions = torch.tensor(positions, dtype=torch.int64)
            plan.prompt_targets = torch.tensor(targets, dtype=torch.int64)

    def _writes(self, sched: SchedulerOutput, admitted: list[AsyncRequest],
                grown: list[AsyncRequest]) -> StagedWrites:
        """The step's writes to persistent state: admitted rows, the block-table rows of ``grown`` (their
        blocks do not fit the row table's columns), restores of hits."""
        w = StagedWrites(self._writes_buffers.take(self.num_plans))
        if admitted:
            tokens = np.full((len(admitted), self.state.token_ids.shape[1]), -1, dtype=np.int64)
            for i, req in enumerate(admitted):
                ids = req.prompt_token_ids + req.output_token_ids
                tokens[i, : len(ids)] = ids
            i32 = {"dtype": torch.int32}
            w.add("admit.idx", torch.tensor([r.idx for r in admitted]))  # [n] request slots
            w.add("admit.token_rows", torch.from_numpy(tokens))  # [n, L] committed tokens, then -1
            w.add("admit.num_tokens", torch.tensor([r.num_tokens for r in admitted], **i32))  # [n]
            w.add("admit.num_prompt", torch.tensor([len(r.prompt_token_ids) for r in admitted], **i32))  # [n]
            w.add("admit.slots", torch.tensor([r.state_slots for r in admitted], **i32))  # [n, K+1]
            # [n] tokens a prefix-cache hit serves (0 without one)
            w.add("admit.num_computed", torch.tensor([r.num_computed_tokens for r in admitted], **i32))
            ProcessorState.staged_writes(w, [r.processors for r in admitted])  # every admitted slot, always
            self.state.sampling.staged_writes(w, admitted)  # every admitted slot, always (greedy ones too)
        if grown:
            width = self.state.block_table.shape[1]
            table = np.full((len(grown), width), self.state.sink_block, dtype=np.int32)
            for i, req in enumerate(grown):
                table[i, : len(req.block_ids)] = req.block_ids
                req.num_staged_blocks = len(req.block_ids)
            w.add("blocks.idx", torch.tensor([r.idx for r in grown]))  # [m] request slots
            w.add("blocks.rows", torch.from_numpy(table))  # [m, B] block ids, the sink block past its own
        if sched.restores:  # [h, 2] (checkpoint slot, s_0) per request admitted on a hit
            w.add("restores", torch.tensor([(r.checkpoint, r.slot) for r in sched.restores]))
        return w
