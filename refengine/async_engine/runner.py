"""The async runner: turns a host step plan into one program on the device timeline.

``enqueue`` copies the plan's staged row table to the device (one copy, a FULL step's padding rows
included) and submits the step; the host gets a future and goes on scheduling the next step. Every
step runs the same program over a table padded by request count (``Np`` rows; padding rows have
request slot -1 and run zero tokens):

    stage       the step's staged writes (admissions, a new owner's block-table row, prefix-cache restores:
                a hit's checkpoint into its s_0), one copy, land in the persistent state (outside the
                program; a FULL step of running requests has none)
    prepare     the blocks the rows' requests got since their last step into the block table (row table
                columns); input ids, positions and slot mappings on the device; padded attention/recurrent
                metadata
    run         the model
    verify      the structured-outputs bitmask the host built for the step (``grammar.py``: a position's
                row is the grammar's after the drafts before it), the requests' logits processors
                (``processing.py``: each verify position sees the drafts before it as decoded), then
                verification of every row's last 1 + drafts tokens (greedy, or ``refengine.sampling``'s
                seeded rejection sampling in a step with a sampling row)
                against the drafts the device holds (a decode row runs 1+K tokens; its drafter may have
                proposed fewer, and only those are compared); rows that do not sample (prompt chunks,
                padding) are flagged and keep nothing
    commit      the device-authoritative state advances by what was kept (the processors' output
                counts too)
    draft       the drafter proposes the next step's drafts (and how many) into the device state
    checkpoint  (prefix caching) the state at each block boundary a row's kept tokens reached is copied
                into the checkpoint slot the host held for it (a column of the row table); every other
                copy goes to a sink slot (after drafting: a draft model's states are checkpointed too)

The program reads the row table, the persistent state and the step's padded shape (host ints that
a FULL graph's key fixes), and nothing back to the host, so a FULL step captures it once per padded
size and replays it; other steps run it eagerly. Then the kept tokens are copied back (the one sync
the host waits on), with how many drafts each row verified, in one copy (``StepOutputs.results``).

A step with structured-outputs rows runs the program in two parts, as vLLM splits execute_model and
sample_tokens: ``forward`` (prepare, run) is enqueued with the plan; ``finish`` (verify onwards) once the
host has processed the step before, advanced the grammars by its kept tokens and built this step's
bitmask from the drafts that step proposed (copied back with its tokens): ``complete`` copies the bitmask
into a static device buffer and enqueues ``finish``. The host waits on nothing it did not wait on before;
the device runs the forward meanwhile. In a FULL step each part is its own graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from kernels.input_prep import post_update, prepare_inputs
from refengine import sampling as seeded
from refengine.async_engine.graphs import PieceGraphs, StepGraphs, StepShape
from refengine.async_engine.inputs import StepRows
from refengine.async_engine.metadata import MetadataBuilder
from refengine.async_engine.planner import StepPlan
from refengine.async_engine.processing import logprob_tables
from refengine.async_engine.state import DeviceState
from refengine.async_engine.stream import Event, HostBuffer, HostRing, Stream
from refengine.config import GraphMode
from refengine.drafters.base import DraftInputs, DraftOutputs, attn_shapes, check_vocab_ids
from refengine.forward_context import AttnMetadata, ForwardContext, RecurrentMetadata
from refengine.grammar import apply_bitmask
from refengine.logits_process import MAX_LOGPROBS, raw_logprobs, top_logprobs
from refengine.prefix_cache import geometry


@dataclass
class PreparedStep:
    """The device tensors of one step (Np padded rows, Tp padded tokens)."""

    qsl: torch.Tensor  # [Np+1] int32 query_start_loc, padding rows repeat the last value
    input_ids: torch.Tensor  # [Tp] int64
    positions: torch.Tensor  # [Tp] int64
    seq_lens: torch.Tensor  # [Np] int32
    slot_mapping: torch.Tensor  # [Tp] int64
    attn: AttnMetadata  # padded per the step's shape
    recurrent: RecurrentMetadata  # padded per the step's shape
    prev_drafts: torch.Tensor  # [Np, K] int64, the drafts this step verifies (filler ids past num_drafts)
    num_drafts: torch.Tensor  # [Np] int64, drafts each row verifies: the device's count (<= the host's K) for
    #                           decode rows, 0 for prefill rows
    used_num_valid: torch.Tensor  # [Np] int32, the num_valid the recurrent kernels were handed (1: prefill)
    used_initial_state: torch.Tensor  # [Np] bool, has_initial_state the kernels were handed (decodes: True)
    start: torch.Tensor  # [Np] int64, num_computed of each row's request before the step (its first position)
    aux_hidden: torch.Tensor | None = None  # [Tp, n*H] the drafter's aux_layers states once the model ran


@dataclass
class Verified:
    cu: torch.Tensor  # [Np+1] int64, logits rows of each row (1 + its draft positions)
    logits: torch.Tensor  # [M, V] float32
    sampled: torch.Tensor  # [Np, K+1] int64, kept tokens then -1 (all -1 for rows that do not sample)
    num_valid: torch.Tensor  # [Np] int32, tokens kept per row (1 for rows that do not sample)
    # the raw logprobs of each row's positions: top values [Np, K+1, N], top ids [Np, K+1, N], the kept
    # token's [Np, K+1] (``processing.logprob_tables``)
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class StepOutputs:
    """Everything one run of the program leaves on the device (padded; static buffers on a replay)."""

    step: PreparedStep
    verified: Verified
    kept: torch.Tensor  # [Np] int64, positions of each row now committed
    drafts: DraftOutputs | None  # None without a drafter
    next_drafts: torch.Tensor  # [Np, K] int64, the drafts proposed for the next step
    next_num_drafts: torch.Tensor  # [Np] int32, how many of them were proposed
    hidden: torch.Tensor | None = None  # [Tp, H] the target's hidden states (prompt logprobs read them)
    # [Np, K+3] int64 what the host reads of every step, in one copy: the kept tokens then -1 (K+1), how many
    # were kept, how many drafts the row verified
    results: torch.Tensor | None = None


@dataclass
class StepPayload:
    """What observers read of one step, on the host: n real rows, T real tokens, M logits rows."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    used_num_valid: torch.Tensor  # [n] int32, the num_valid the recurrent kernels were handed
    used_initial_state: torch.Tensor  # [n] bool
    prev_drafts: torch.Tensor  # [n, K] int64
    logits: torch.Tensor  # [M, V] float32
    cu: torch.Tensor  # [n+1] int64, logits rows of each row
    kept: torch.Tensor  # [n] int64
    first_pass_ids: torch.Tensor | None  # [T] ids the drafter's first pass was fed, or None
    chain_ids: torch.Tensor | None  # [n, c] ids fed to the drafter's chained passes, or None
    next_drafts: torch.Tensor  # [n, K] int64
    next_num_drafts: torch.Tensor  # [n] int32
    metadata_shapes: dict  # "group.field" -> shape of every per-request tensor handed to the kernels

    @classmethod
    def of(cls, out: StepOutputs, n: int, t: int, m: int) -> StepPayload:
        """Host copies, complete once the step's event has passed (no wait here)."""
        s, v, d = out.step, out.verified, out.drafts
        shapes = {**s.recurrent.shapes(), **attn_shapes("attn", s.attn)}
        if d is not None:
            shapes.update(d.metadata_shapes)
        return cls(
            to_host(s.input_ids[:t]),
            to_host(s.positions[:t]),
            to_host(s.used_num_valid[:n]),
            to_host(s.used_initial_state[:n]),
            to_host(s.prev_drafts[:n]),
            to_host(v.logits[:m]),
            to_host(v.cu[: n + 1]),
            to_host(out.kept[:n]),
            None if d is None or d.first_pass_ids is None else to_host(d.first_pass_ids[:t]),
            None if d is None else to_host(d.chain_ids[:n]),
            to_host(out.next_drafts[:n]),
            to_host(out.next_num_drafts[:n]),
            shapes,
        )


@dataclass
class StepFuture:
    plan: StepPlan
    event: Event | None
    # [Np, K+3] int64 host, ``StepOutputs.results`` copied back (in a buffer of the runner's, reused two
    # steps later); the three below are views of its first n rows
    results: torch.Tensor
    sampled: torch.Tensor  # [n, K+1] host, kept tokens then -1
    num_valid: torch.Tensor  # [n] host
    num_drafts: torch.Tensor  # [n] host, drafts each row verified (the device's count)
    # structured outputs with speculation: the drafts each row proposed for its next step [n, K] and how many
    # [n] (host copies; the host builds the next step's grammar bitmask from them), else None
    next_drafts: torch.Tensor | None = None
    next_num_drafts: torch.Tensor | None = None
    staged: tuple | None = None  # a step run in parts: (padded row table, forward's outputs), device timeline
    payload: StepPayload | None = None  # observer data, filled on the device timeline when recording
    logprobs: tuple | None = None  # host copies of ``Verified.logprobs`` [:n] when the plan asks for them
    # host copies of the plan's prompt logprobs: top values [P, N], top ids [P, N], the target's [P]
    prompt_logprobs: tuple | None = None
    # debug mode: host copies of the drafter's first-pass ids [T], qsl [n+1], slots [n], positions [T], and
    # the vocabulary size, checked once the step is done (a check inside the step would wait for it)
    drafter_ids: tuple | None = None
    buffer: HostBuffer | None = None  # the host buffer ``results`` is a view of

    def row_prompt_logprobs(self, i: int) -> tuple[int, list] | None:
        """Row ``i``'s (first prompt index, (top values, top ids, the prompt token's logprob) per position),
        or None when its chunk yields none."""
        k = 0
        for row, first, count in self.plan.prompt_logprobs:
            if row == i:
                values, ids, chosen = (t[k: k + count] for t in self.prompt_logprobs)
                return first, [(v, t, c) for v, t, c in zip(values.tolist(), ids.tolist(), chosen.tolist())]
            k += count
        return None

    def row_logprobs(self, i: int, num_kept: int) -> list[tuple[list[float], list[int], float]]:
        """Row ``i``'s (top values, top ids, kept token's logprob) per kept token."""
        values, ids, chosen = self.logprobs
        return [(values[i, p].tolist(), ids[i, p].tolist(), float(chosen[i, p])) for p in range(num_kept)]

    def result(self) -> tuple[list[list[int]], list[int]]:
        """Once the step is done: each row's kept tokens (bonus included) and the drafts it verified."""
        self.event.wait()
        if self.drafter_ids is not None:
            check_vocab_ids(*self.drafter_ids)
        rows, k1 = self.results[: self.num_valid.shape[0]].tolist(), self.sampled.shape[1]
        return [r[: r[k1]] for r in rows], [r[k1 + 1] for r in rows]


class AsyncRunner:
    def __init__(self, model, caches, state: DeviceState, stream: Stream, builder: MetadataBuilder, proposer,
                 *, block_size: int, num_speculative_tokens: int, recurrent_prefill_chunked: bool,
                 vocab_size: int, check_inputs: bool = False, sink_checkpoint: int | None = None,
                 num_checkpoint_columns: int = 0, max_rows: int = 0):
        """``sink_checkpoint``: with prefix caching, the state slot that unwanted checkpoint copies go to;
        ``num_checkpoint_columns`` (P): the boundaries one row's step can reach; ``max_rows``: the most
        padded rows of a step (the grammar bitmask's rows)."""
        self.model = model
        self.caches = caches
        self.state = state
        self.stream = stream
        self.builder = builder
        self.proposer = proposer  # the drafter's device proposer, or None without speculation
        self.aux_layers = tuple(getattr(proposer, "aux_layers", ()))  # target layers the drafter reads
        self.block_size = block_size
        self.num_speculative_tokens = num_speculative_tokens
        self.recurrent_prefill_chunked = recurrent_prefill_chunked
        self.device = stream.device
        width = StepRows.width(num_checkpoint_columns)
        # the steps' device row tables; FULL steps: one captured program per padded request count
        self.graphs = StepGraphs(self.device, max_rows, width)
        # piecewise steps: the model's token-wise pieces, one graph per piece and padded token count
        self.pieces = PieceGraphs(self.device)
        self.check_inputs = check_inputs  # debug mode: read drafter ids back and refuse bad ones
        self.vocab_size = vocab_size
        self.sink_checkpoint = sink_checkpoint
        self.num_checkpoint_columns = num_checkpoint_columns
        # [F] a padding row: it holds the sink slot for each of its P boundaries
        self._inert = StepRows.inert_row(num_speculative_tokens, self.device,
                                         [sink_checkpoint] * num_checkpoint_columns)
        sinks = [sink_checkpoint] * num_checkpoint_columns
        self._inert_row = StepRows.pack([StepRows.inert_values(num_speculative_tokens, sinks)])[0]  # [F] host
        # [R, K+3] int64 host: the steps' results copied back, taken in turn (``new_future``)
        self._results = HostRing("step-results", stream, (max(max_rows, 1), num_speculative_tokens + 3),
                                 torch.int64)
        self._result_views: dict[tuple, tuple] = {}  # (buffer, Np, n) -> the views a future reads
        self._staging = torch.empty(0, dtype=torch.int64, device=self.device)  # [W] the staged writes' copy
        # [block_size, P] the column holding a verify row's p-th boundary, by its start % block_size
        self.checkpoint_columns = torch.tensor(geometry.column_table(block_size, num_checkpoint_columns),
                                               dtype=torch.int64, device=self.device).reshape(block_size, -1)
        # [R, K+1, W] int32 the step's grammar bitmask (padded row, position, 32 ids a word), static for FULL
        self.grammar_mask = torch.full((max_rows, num_speculative_tokens + 1, (vocab_size + 31) // 32), -1,
                                       dtype=torch.int32, device=self.device)

    def enqueue(self, plan: StepPlan) -> StepFuture:
        """The step's row table (a FULL step's padding rows added on the host) copied into the device's
        table in one transfer, and the step submitted."""
        shape = plan.shape
        n, n_pad = shape.num_reqs, shape.num_reqs_padded
        if n_pad > n:
            plan.inputs.array[n:n_pad] = self._inert_row
        table = self.graphs.table(n_pad)
        self.stream.copy(table, plan.inputs.rows(n_pad))
        fut = self.new_future(plan)
        if shape.grammar:
            self.stream.submit(lambda: self._forward(plan, table, fut))  # ``complete`` enqueues the rest
            self._pending(plan, fut, self.stream.record_event())
            return fut
        self.stream.submit(lambda: self._execute(plan, table, fut))
        fut.event = self.stream.record_event()
        self._pending(plan, fut, fut.event)
        return fut

    def _pending(self, plan: StepPlan, fut: StepFuture, event: Event) -> None:
        """The step's host buffers are in use until ``event`` (the step's, or its first part's)."""
        plan.inputs.pending = event
        if plan.writes.host is not None:
            plan.writes.host.pending = event
        fut.buffer.pending = event

    def new_future(self, plan: StepPlan) -> StepFuture:
        """The host tensors a step's results are copied into. On CUDA they are pinned: a copy into pageable
        memory would block the host until the step is done, the wait asynchronous scheduling exists to
        avoid (tests/fakecuda/test_host_copies.py holds every copy back to the host to that)."""
        n, k = plan.shape.num_reqs, self.num_speculative_tokens
        buffer = self._results.take(plan.index)
        key = (id(buffer), plan.shape.num_reqs_padded, n)
        views = self._result_views.get(key)
        if views is None:  # [Np, K+3], then the real rows' kept tokens, counts and drafts
            results = buffer.rows(plan.shape.num_reqs_padded)
            views = self._result_views[key] = (results, results[:n, : k + 1], results[:n, k + 1],
                                               results[:n, k + 2])
        fut = StepFuture(plan, None, *views, buffer=buffer)
        pin = self.device.type == "cuda"
        if plan.logprobs:
            top = min(MAX_LOGPROBS, self.vocab_size)
            fut.logprobs = (torch.zeros(n, k + 1, top, pin_memory=pin),
                            torch.zeros(n, k + 1, top, dtype=torch.int64, pin_memory=pin),
                            torch.zeros(n, k + 1, pin_memory=pin))
        if plan.prompt_logprobs:
            p, top = plan.prompt_positions.shape[0], min(MAX_LOGPROBS, self.vocab_size)
            fut.prompt_logprobs = (torch.zeros(p, top, pin_memory=pin),
                                   torch.zeros(p, top, dtype=torch.int64, pin_memory=pin),
                                   torch.zeros(p, pin_memory=pin))
        if plan.shape.grammar and k:  # the drafts the host builds the next step's bitmask from
            fut.next_drafts = torch.zeros(n, k, dtype=torch.int64, pin_memory=pin)
            fut.next_num_drafts = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        return fut

    def complete(self, fut: StepFuture, bitmask: HostBuffer) -> None:
        """Enqueue the rest of a step run in parts, with its grammar ``bitmask`` [Np, K+1, W] (host)."""
        n_pad = fut.plan.shape.num_reqs_padded
        self.stream.copy(self.grammar_mask[:n_pad], bitmask.tensor, host=bitmask)
        self.stream.submit(lambda: self._finish(fut.plan, fut))
        fut.event = self.stream.record_event()
        fut.buffer.pending = fut.event

    def _forward(self, plan: StepPlan, padded: torch.Tensor, fut: StepFuture) -> None:
        """Device timeline, first part: staging and the model; ``finish`` reads what it leaves. ``padded``
        [Np, F]: the step's row table on the device."""
        shape = plan.shape
        self.stage(plan)
        rows = self.graphs.rows(padded)

        def finish_over(staged):  # a FULL graph's second part, captured with the first
            return lambda: self.finish(shape, rows, *staged)

        fut.staged = (padded, self.graphs.run(shape, padded, self._inert, lambda: self.forward(shape, rows),
                                              part=1, then=finish_over))

    def _finish(self, plan: StepPlan, fut: StepFuture) -> None:
        shape, (padded, (step, hidden)) = plan.shape, fut.staged
        fut.staged = None
        out = self.graphs.run(shape, padded, self._inert,
                              lambda: self.finish(shape, self.graphs.rows(padded), step, hidden), part=2)
        self._outputs(plan, padded, fut, out)

    def _execute(self, plan: StepPlan, padded: torch.Tensor, fut: StepFuture) -> None:
        """Device timeline: ``padded`` [Np, F] is the step's row table, copied from the host."""
        shape = plan.shape
        self.stage(plan)
        rows = self.graphs.rows(padded)
        out = self.graphs.run(shape, padded, self._inert, lambda: self.program(shape, rows))
        self._outputs(plan, padded, fut, out)

    def _outputs(self, plan: StepPlan, padded: torch.Tensor, fut: StepFuture, out: StepOutputs) -> None:
        """Device timeline: the step's results copied back to the host (asynchronously)."""
        shape, n = plan.shape, plan.shape.num_reqs
        if self.check_inputs and out.drafts is not None and out.drafts.first_pass_ids is not None:
            t = shape.num_tokens
            fut.drafter_ids = (to_host(out.drafts.first_pass_ids[:t]), to_host(out.step.qsl[: n + 1]),
                               to_host(self.graphs.rows(padded).idx[:n]), to_host(out.step.positions[:t]),
                               self.vocab_size)
        fut.results.copy_(out.results, non_blocking=True)
        if fut.next_drafts is not None:
            fut.next_drafts.copy_(out.next_drafts[:n], non_blocking=True)
            fut.next_num_drafts.copy_(out.next_num_drafts[:n], non_blocking=True)
        if fut.logprobs is not None:
            for host, dev in zip(fut.logprobs, out.verified.logprobs):
                host.copy_(dev[:n], non_blocking=True)
        if fut.prompt_logprobs is not None:  # copied back with the step's other outputs: no wait added
            for host, dev in zip(fut.prompt_logprobs, self.prompt_logprobs(plan, out.hidden)):
                host.copy_(dev, non_blocking=True)
        if plan.record:
            m = sum(1 + len(row.draft_token_ids) for row in plan.rows)
            fut.payload = StepPayload.of(out, n, shape.num_tokens, m)

    def program(self, shape: StepShape, rows: StepRows) -> StepOutputs:
        """The whole step over ``rows`` [Np]: reads only them, the persistent state and ``shape``'s padded
        sizes."""
        return self.finish(shape, rows, *self.forward(shape, rows))

    def forward(self, shape: StepShape, rows: StepRows) -> tuple[PreparedStep, torch.Tensor]:
        """The program's first part: inputs prepared on the device and the model run (hidden [Tp, H])."""
        step = self.prepare(shape, rows, self.state.num_computed)
        return step, self.run(step, self._pieces(shape))

    def _pieces(self, shape: StepShape) -> PieceGraphs | None:
        """The piece graphs a step's model forward replays: a PIECEWISE step's on CUDA, else None (eager). A
        step run in parts (structured outputs) runs eagerly: its forward's outputs must hold until ``finish``,
        and a later step's forward may replay the same pieces before that."""
        piecewise = shape.mode is GraphMode.PIECEWISE and not shape.grammar
        if piecewise and self.pieces.live(shape.num_tokens_padded):
            return self.pieces
        return None

    def finish(self, shape: StepShape, rows: StepRows, step: PreparedStep,
               hidden: torch.Tensor) -> StepOutputs:
        """The program's second part: verification (the grammar bitmask applied), commit, checkpoints and
        drafts."""
        verified = self.verify(shape, rows, step, hidden)
        self.commit(rows, verified)
        if shape.processors:  # the processors' output counts advance by the kept tokens (no request reads
            self.state.processors.advance(rows.idx, verified.sampled)  # them in a step without processors)
        kept, drafts = self.draft(rows, step, hidden, verified, self._pieces(shape))
        if self.num_checkpoint_columns:  # after the drafter: a draft model's first pass writes its states
            self.checkpoint(rows, step, verified)
        st = self.state
        results = torch.cat([verified.sampled, verified.num_valid[:, None].long(), step.num_drafts[:, None]],
                            1)
        return StepOutputs(step, verified, kept, drafts, st.draft_tokens[rows.idx], st.num_drafts[rows.idx],
                           hidden, results)

    def prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor):
        """The raw logprobs of the plan's prompt positions (never processed): (top values [P, N], top ids
        [P, N], the next prompt token's [P]). Only a step with a prefill row asks, so never a FULL one."""
        at = to_device(plan.prompt_positions, self.device)
        targets = to_device(plan.prompt_targets, self.device)
        raw = raw_logprobs(self.model.compute_logits(hidden[at]))
        values, ids = top_logprobs(raw)
        return values, ids, raw.gather(1, targets[:, None])[:, 0]

    # ---- the stages ----------------------------------------------------------------------------------
    def stage(self, plan: StepPlan) -> None:
        """The plan's staged writes, copied in one transfer, land in the persistent state: admissions (and
        the drafter's), block-table rows, then the hits' restores (so a hit's first chunk reads them)."""
        if not plan.writes:
            return
        w = plan.writes.unpack(self._staged(plan.writes.packed()))
        if "admit.idx" in w:
            self.state.admit(w["admit.idx"], w["admit.token_rows"], w["admit.num_tokens"],
                             w["admit.num_prompt"], w["admit.slots"], w["admit.num_computed"])
            self.state.processors.admit(w["admit.idx"], w, w["admit.token_rows"], w["admit.num_tokens"],
                                        w["admit.num_prompt"])
            self.state.sampling.admit(w["admit.idx"], w)
            if self.proposer is not None:
                self.proposer.admit(w["admit.idx"], plan.drafter_admission)
        if "blocks.idx" in w:
            self.state.block_table[w["blocks.idx"]] = w["blocks.rows"]
        if "restores" in w:
            self.caches.restore_checkpoints(w["restores"][:, 0], w["restores"][:, 1])

    def _staged(self, packed: torch.Tensor) -> torch.Tensor:
        """``packed`` [W] (the staged writes, on the host) in the device's staging buffer: one copy, into a
        buffer kept across steps (grown when a step stages more). On CPU the host tensor itself."""
        if packed.device == self.device:
            return packed
        if packed.shape[0] > self._staging.shape[0]:
            self._staging = torch.empty(max(packed.shape[0], 2 * self._staging.shape[0]), dtype=torch.int64,
                                        device=self.device)
        flat = self._staging[: packed.shape[0]]
        flat.copy_(packed, non_blocking=True)
        return flat

    def prepare(self, shape: StepShape, rows: StepRows, num_computed: torch.Tensor) -> PreparedStep:
        """``num_computed`` [R]: where positions come from, the device's authoritative counts (contract 4).

        Padding rows (request slot -1) gather the state's sink row and run zero tokens.
        """
        st, dev = self.state, self.device
        self.grow_blocks(rows)
        n_pad = rows.idx.shape[0]
        qsl = torch.zeros(n_pad + 1, dtype=torch.int32, device=dev)
        qsl[1:] = rows.query_len.cumsum(0)
        idx, is_decode = rows.idx.to(torch.int32), rows.is_decode.bool()
        input_ids, positions, seq_lens, slot_mapping = prepare_inputs(
            idx_mapping=idx, query_start_loc=qsl, is_decode=is_decode, num_computed=num_computed,
            last_sampled=st.last_sampled, draft_tokens=st.draft_tokens, token_ids=st.token_ids,
            block_table=st.block_table, block_size=self.block_size, num_tokens_padded=shape.num_tokens_padded)
        attn, recurrent = self.builder.build(shape, rows, qsl, seq_lens, slot_mapping)
        used_num_valid = torch.ones(n_pad, dtype=torch.int32, device=dev)
        decode = recurrent.decode
        if decode is not None and decode.num_valid is not None:
            used_num_valid[: shape.num_decode_rows] = decode.num_valid[: shape.num_decode_rows]
        used_initial_state = torch.ones(n_pad, dtype=torch.bool, device=dev)
        if recurrent.prefill is not None:
            used_initial_state[shape.num_decode_rows:] = recurrent.prefill.has_initial_state
        # A decode row runs the host's K draft positions; the drafter may have filled fewer of them.
        num_drafts = torch.minimum(st.num_drafts[rows.idx].long(), rows.num_draft_positions)
        num_drafts = torch.where(is_decode, num_drafts, torch.zeros_like(num_drafts))
        return PreparedStep(qsl, input_ids, positions, seq_lens, slot_mapping, attn, recurrent,
                            st.draft_tokens[rows.idx], num_drafts, used_num_valid, used_initial_state,
                            num_computed[rows.idx].long())

    def grow_blocks(self, rows: StepRows) -> None:
        """The KV blocks each row's request got since its last step (the row table's block columns) into its
        block-table row. An entry without one writes the sink row's first entry, which holds the sink
        block already, so the write is the same program whatever the rows got."""
        at = torch.stack([rows.block_at0, rows.block_at1], 1)  # [Np, 2]
        got = at >= 0
        slot = torch.where(got, rows.idx[:, None], -1)  # -1: the sink row
        ids = torch.where(got, torch.stack([rows.block_id0, rows.block_id1], 1), self.state.sink_block)
        self.state.block_table[slot, at.clamp(min=0)] = ids.to(torch.int32)

    def run(self, step: PreparedStep, pieces: PieceGraphs | None = None) -> torch.Tensor:
        ctx = ForwardContext(attn=step.attn, recurrent=step.recurrent, kv_caches=self.caches.kv,
                             states=self.caches.states,
                             recurrent_prefill_chunked=self.recurrent_prefill_chunked,
                             aux_layers=self.aux_layers, pieces=pieces)
        hidden = self.model(step.input_ids, step.positions, ctx)
        if self.aux_layers:
            step.aux_hidden = ctx.aux_hidden_states()
        return hidden

    def verify(self, shape: StepShape, rows: StepRows, step: PreparedStep, hidden: torch.Tensor) -> Verified:
        """Greedy verification of every row's last 1 + draft positions; rows that do not sample keep nothing.

        The logits cover the host-scheduled draft positions (``shape.num_logits``, the sum of 1 + draft
        positions over the padded rows, sizes them, so no index arithmetic reads the device); only the
        drafts the device holds (``step.num_drafts``) are compared, so a row keeps at most 1 + those.
        """
        dev, m = self.device, shape.num_logits
        counts = rows.num_draft_positions + 1  # [Np]
        cu = torch.zeros(counts.shape[0] + 1, dtype=torch.int64, device=dev)
        cu[1:] = counts.cumsum(0)
        starts = (step.qsl[1:].long() - counts).clamp(min=0)  # each row's last committed token
        offsets = torch.arange(m, device=dev) - torch.repeat_interleave(cu[:-1], counts, output_size=m)
        logit_idx = torch.repeat_interleave(starts, counts, output_size=m) + offsets
        logits = self.model.compute_logits(hidden[logit_idx])
        # [M] the padded row of each logits row
        row = torch.repeat_interleave(torch.arange(counts.shape[0], device=dev), counts, output_size=m)
        masked = logits
        if shape.grammar:  # the bitmask rows the host built: padded row, then position in its window
            masked = apply_bitmask(logits, self.grammar_mask[row, offsets])
        processed = masked
        if shape.processors:  # a step none of whose rows has processors verifies the raw logits
            st = self.state
            slot, idx = rows.idx[row], rows.idx.long()
            num_outputs = (st.num_tokens[idx] - st.num_prompt[idx]).long()  # [Np]
            lp = st.processors.bad_prefix.shape[2]
            at = st.num_tokens[idx].long()[:, None] - lp + torch.arange(lp, device=dev)[None, :]
            at = at.clamp(min=0)
            tail = st.token_ids[idx[:, None], at]  # [Np, L-1] the last committed tokens
            processed = st.processors.apply(masked, slot.long(), row, offsets, num_outputs[row],
                                            step.prev_drafts, tail)
        if shape.sampling:  # seeded rejection sampling for rows with a temperature; greedy rows stay argmax
            first = step.start + rows.query_len - counts + 1  # [Np] the position column 0 chooses a token for
            tokens, num_valid = seeded.verify(processed, step.prev_drafts, step.num_drafts, cu,
                                              self.state.sampling.rows(rows.idx), first)
        else:
            tokens, num_valid = kernels.greedy_verify(processed, step.prev_drafts,
                                                      step.num_drafts.to(torch.int32), cu.to(torch.int32))
        sampling = rows.is_sampling.bool()
        sampled = torch.where(sampling[:, None], tokens, torch.full_like(tokens, -1))
        num_valid = torch.where(sampling, num_valid, torch.ones_like(num_valid))
        return Verified(cu, logits, sampled, num_valid,
                        logprob_tables(logits, cu, sampled) if shape.logprobs else None)

    def commit(self, rows: StepRows, v: Verified) -> None:
        """Counted against the host-scheduled draft positions: a row's positions past its kept tokens are
        rejected, whether they held drafts or fillers, so ``num_computed`` advances by ``num_valid``."""
        st = self.state
        post_update(
            idx_mapping=rows.idx.to(torch.int32),
            query_lens=rows.query_len.to(torch.int32),
            num_draft_tokens=rows.num_draft_positions.to(torch.int32),
            is_sampling=rows.is_sampling.bool(),
            sampled=v.sampled,
            num_valid=v.num_valid,
            num_computed=st.num_computed,
            num_valid_state=st.num_valid,
            last_sampled=st.last_sampled,
            token_ids=st.token_ids,
            num_tokens=st.num_tokens,
        )

    def checkpoint(self, rows: StepRows, step: PreparedStep, v: Verified) -> None:
        """Copy the state at each block boundary a row's kept tokens reached into the slot held for it.

        Entry p of a row (``rows.checkpoint_slots``, [Np, P]) is its p-th boundary after its first position
        (``geometry``): a verify row holds it in column ``checkpoint_columns[start % block_size, p]``,
        kept iff that column is below ``num_valid``; a prefill row holds only its chunk end, when that is
        on the grid (p = 0, column 0). Entries not reached, and rows the host held nothing for, copy to
        the sink slot, so the copy is the same program whatever the verifier kept (no host read).
        """
        st, bs, k = self.state, self.block_size, self.num_speculative_tokens
        held = rows.checkpoint_slots  # [Np, P]
        p = torch.arange(held.shape[1], device=held.device)[None, :]  # [1, P]
        column = self.checkpoint_columns[step.start % bs]  # [Np, P] verify rows
        verify_reached = column < v.num_valid.long()[:, None]
        prefill_reached = (p == 0) & geometry.ends_on_boundary(step.start, rows.query_len, bs)[:, None]
        decode = rows.is_decode.bool()[:, None]
        reached = torch.where(decode, verify_reached, prefill_reached)
        column = torch.where(decode, column, torch.zeros_like(column)).clamp(0, k)
        slots = st.state_slots[rows.idx].long()  # [Np, K+1]
        dst = torch.where(reached, held, torch.full_like(held, self.sink_checkpoint))
        self.caches.save_checkpoints(slots[:, :1].expand_as(column).flatten(), column.flatten(),
                                     slots.gather(1, column).flatten(), dst.flatten())

    def draft(self, rows: StepRows, step: PreparedStep, hidden: torch.Tensor, v: Verified,
              pieces: PieceGraphs | None = None) -> tuple[torch.Tensor, DraftOutputs | None]:
        """Returns the kept positions per row [Np] and what the proposer reports (None without one)."""
        sampling = rows.is_sampling.bool()
        rejected = rows.num_draft_positions - (v.num_valid.long() - 1)
        kept = rows.query_len - torch.where(sampling, rejected, torch.zeros_like(rejected))
        if self.proposer is None:
            return kept, None
        out = self.proposer.propose(DraftInputs(
            idx=rows.idx, query_start_loc=step.qsl, is_sampling=sampling, backup_token=rows.backup_token,
            kept=kept, input_ids=step.input_ids, positions=step.positions, hidden=hidden, attn=step.attn,
            recurrent=step.recurrent, is_decode=rows.is_decode.bool(),
            recurrent_prefill_chunked=self.recurrent_prefill_chunked, aux_hidden=step.aux_hidden,
            pieces=pieces))
        st = self.state
        st.draft_tokens[rows.idx] = torch.where(sampling[:, None], out.drafts, st.draft_tokens[rows.idx])
        proposed = (
            torch.full_like(rows.idx, self.num_speculative_tokens)
            if out.num_drafts is None
            else out.num_drafts
        )
        st.num_drafts[rows.idx] = torch.where(sampling, proposed, st.num_drafts[rows.idx].long()).to(
            torch.int32
        )
        return kept, out


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of device tensor ``t``, to read once the step's event has passed. On CUDA it lands in
    pinned memory without the host waiting (into pageable memory the copy would wait for the step); on
    the CPU (the device timeline's worker thread) it is a clone, which later steps do not overwrite."""
    if t.device.type == "cuda":
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
    return t.clone()


def to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on ``dev`` without making the host wait for the work already queued there.

    A copy from pageable memory blocks the host until the stream reaches it (that is, until the step
    in flight is done); from pinned memory it is queued like any other work.
    """
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t
