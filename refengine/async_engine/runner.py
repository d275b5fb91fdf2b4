"""The async runner: turns a host step plan into one program on the device timeline.

``enqueue`` copies the plan's staged tables to the device and submits the step program; the host
gets a future and goes on scheduling the next step. The program is six small stages:

    stage    admissions, block-table growth and drafter tables land in the persistent state
    prepare  input ids, positions and slot mappings on the device; padded attention/GDN metadata
    run      the model (a FULL graph replay where the step allows one)
    verify   greedy verification of the rows that reach their last token
    commit   the device-authoritative state advances by what was kept
    draft    the drafter proposes the next step's drafts into the device state

then the sampled tokens are copied back (the one sync the host waits on).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels
from kernels.input_prep import post_update, prepare_inputs
from refengine.async_engine.graphs import StepGraphs, StepShape
from refengine.async_engine.inputs import DrafterRows, TargetRows
from refengine.async_engine.metadata import MetadataBuilder, StepTensors, pad_qsl, pad_rows
from refengine.async_engine.stream import Event, HostBuffer, Stream
from refengine.config import GraphMode
from refengine.drafters import DraftInputs
from refengine.drafters.base import DraftOutputs, UniformDraftInputs, attn_shapes, check_vocab_ids
from refengine.forward_context import AttnMetadata, ForwardContext, RecurrentMetadata


@dataclass
class Admission:
    """Host-staged rows of newly admitted (or resumed) requests."""

    idx: torch.Tensor  # [n] int64 request slots
    token_rows: torch.Tensor  # [n, L] int64, committed tokens then -1
    num_tokens: torch.Tensor  # [n] int32
    num_prompt: torch.Tensor  # [n] int32
    slots: torch.Tensor  # [n, K+1] int32
    drafter: object = None  # what the drafter's proposer staged for them (its own tables), or None


@dataclass
class StepPlan:
    index: int
    rows: list  # ScheduledRow, in batch order (decode rows first)
    shape: StepShape
    num_decode: int
    qsl: list[int]  # [N+1] host query_start_loc (query lengths are scheduling facts, not device state)
    target_rows: HostBuffer  # TargetRows table [N, F]
    drafter_rows: HostBuffer  # DrafterRows table [N, F]
    slots: list[list[int]]  # per row: the request's GDN slots s_0..s_K (snapshot, for records)
    preempted: list[str] = field(default_factory=list)  # for records: preempted when this step was scheduled
    resumed: list[str] = field(default_factory=list)  # for records: readmitted after a preemption
    record: bool = False  # observers want this step's payload
    admission: Admission | None = None
    block_idx: torch.Tensor | None = None  # [m] int64 request slots whose block rows changed
    block_rows: torch.Tensor | None = None  # [m, B] int32

    @property
    def sampling_rows(self) -> list[int]:
        return [i for i, row in enumerate(self.rows) if row.samples]


@dataclass
class PreparedStep:
    """The device tensors of one step (n real rows, T real tokens, Np/Tp padded)."""

    qsl: torch.Tensor  # [n+1] int32, unpadded query_start_loc
    input_ids: torch.Tensor  # [Tp] int64
    positions: torch.Tensor  # [Tp] int64
    seq_lens: torch.Tensor  # [Np] int32
    slot_mapping: torch.Tensor  # [Tp] int64
    attn: AttnMetadata  # padded per the step's graph shape
    recurrent: RecurrentMetadata  # padded per the step's graph shape
    prev_drafts: torch.Tensor  # [n, K] int64, the drafts this step verifies
    used_accepted: torch.Tensor  # [n] int32, accepted counts the GDN kernels were handed (1 for prefill rows)
    used_initial_state: torch.Tensor  # [n] bool, the has_initial_state the GDN kernels were handed (decodes: True)


@dataclass
class Verified:
    sampling_rows: torch.Tensor  # [Ns] int64
    cu: torch.Tensor  # [Ns+1] int64, logits rows of each sampling row
    logits: torch.Tensor  # [M, V] float32
    sampled: torch.Tensor  # [n, K+1] int64, valid tokens then -1
    num_valid: torch.Tensor  # [n] int32, tokens kept per row (1 for rows that do not sample)


@dataclass
class StaticTables:
    """A FULL step's input tables for Np padded rows: what the program reads, and their inert values."""

    live: dict[str, torch.Tensor]  # "target" -> TargetRows table [Np, F] int64, refilled every step
    inert: dict[str, torch.Tensor]  # the same tables with every row a padding row (for capture)


@dataclass
class StepFuture:
    plan: StepPlan
    event: Event | None
    sampled: torch.Tensor  # [N, K+1] host, valid tokens then -1
    num_valid: torch.Tensor  # [N] host
    payload: dict = field(default_factory=dict)  # observer data, filled on the device timeline

    def result(self) -> tuple[list[list[int]], dict]:
        self.event.wait()
        tokens, counts = self.sampled.tolist(), self.num_valid.tolist()
        return [t[:c] for t, c in zip(tokens, counts)], self.payload


class AsyncRunner:
    def __init__(self, model, caches, state, stream: Stream, builder: MetadataBuilder, proposer,
                 *, block_size: int, num_spec_tokens: int, recurrent_prefill_chunked: bool,
                 vocab_size: int, check_inputs: bool = False):
        self.model = model
        self.caches = caches
        self.state = state
        self.stream = stream
        self.builder = builder
        self.proposer = proposer  # the drafter's device proposer, or None without speculation
        self.block_size = block_size
        self.k = num_spec_tokens
        self.recurrent_prefill_chunked = recurrent_prefill_chunked
        self.device = stream.device
        self.step_graphs = StepGraphs(self.device)  # FULL steps: one graph per padded request count
        self._static: dict[int, StaticTables] = {}  # padded requests -> a FULL step's input tables
        self.check_inputs = check_inputs  # debug mode: read drafter ids back and refuse bad ones
        self.vocab_size = vocab_size

    def enqueue(self, plan: StepPlan) -> StepFuture:
        n = len(plan.rows)
        target = self._upload(plan.target_rows, n)
        drafter = self._upload(plan.drafter_rows, n)
        fut = StepFuture(plan, None, torch.full((n, self.k + 1), -1, dtype=torch.int64),
                         torch.ones(n, dtype=torch.int64))
        self.stream.submit(lambda: self._program(plan, target, drafter, fut))
        fut.event = self.stream.record_event()
        return fut

    def _upload(self, buf: HostBuffer, n: int) -> torch.Tensor:
        cols = buf.tensor.shape[1]
        dst = torch.empty(n, cols, dtype=torch.int64, device=self.device)
        self.stream.copy(dst, buf.tensor[:n], host=buf)
        return dst

    def _program(self, plan: StepPlan, target: torch.Tensor, drafter: torch.Tensor, fut: StepFuture) -> None:
        """``target`` [N, F] and ``drafter`` [N, F]: the step's staged tables, on the device."""
        self.stage(plan)
        if plan.shape.mode is GraphMode.FULL:
            return self._uniform_program(plan, target, fut)
        rows, drafter_rows = TargetRows.view(target), DrafterRows.view(drafter)
        step = self.prepare(plan, rows, self.state.num_computed)
        hidden = self.run(step)
        verified = self.verify(plan, rows, step, hidden)
        self.commit(rows, verified)
        drafts = self.draft(plan, rows, drafter_rows, step, hidden, verified)
        fut.sampled.copy_(verified.sampled, non_blocking=True)
        fut.num_valid.copy_(verified.num_valid, non_blocking=True)
        if plan.record:
            fut.payload.update(_payload(plan, step, verified, drafts),
                               next_drafts=self.state.draft_tokens[rows.idx].cpu())

    # ---- the stages ----------------------------------------------------------------------------------
    def stage(self, plan: StepPlan) -> None:
        dev, a = self.device, plan.admission
        if a is not None:
            idx = to_device(a.idx, dev)
            self.state.admit(idx, to_device(a.token_rows, dev), to_device(a.num_tokens, dev),
                             to_device(a.num_prompt, dev), to_device(a.slots, dev))
            if self.proposer is not None:
                self.proposer.admit(idx, a.drafter)
        if plan.block_idx is not None:
            self.state.block_table[to_device(plan.block_idx, dev)] = to_device(plan.block_rows, dev)

    def prepare(self, plan: StepPlan, rows: TargetRows, num_computed: torch.Tensor) -> PreparedStep:
        """``num_computed`` [R]: where positions come from, the device's authoritative counts (contract 4).

        ``rows`` are the step's n rows, or (FULL) its padded rows, padding rows with request slot -1:
        their gathers read the state's sink row (the last one) and they are inert everywhere else.
        """
        st, shape, dev = self.state, plan.shape, self.device
        n = rows.idx.shape[0]
        qsl = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        qsl[1:] = rows.query_len.cumsum(0)
        rows_p = shape.num_reqs_padded
        idx_p = pad_rows(rows.idx.to(torch.int32), rows_p, -1)
        qsl_p = pad_qsl(qsl, rows_p)
        is_decode_p = pad_rows(rows.is_decode.bool(), rows_p, True)
        input_ids, positions, seq_lens, slot_mapping = prepare_inputs(
            idx_mapping=idx_p, query_start_loc=qsl_p, is_decode=is_decode_p, num_computed=num_computed,
            last_sampled=st.last_sampled, draft_tokens=st.draft_tokens, token_ids=st.token_ids,
            block_table=st.block_table, block_size=self.block_size, num_tokens_padded=shape.num_tokens_padded)
        tensors = StepTensors(idx_p, qsl_p, is_decode_p, pad_rows(rows.has_initial_state.bool(), rows_p, False),
                              seq_lens, slot_mapping)
        attn, recurrent = self.builder.build(tensors, shape, plan.num_decode, plan.qsl)
        used_accepted = torch.ones(n, dtype=torch.int32, device=dev)
        if recurrent.decode is not None and recurrent.decode.num_accepted_tokens is not None:
            used_accepted[: plan.num_decode] = recurrent.decode.num_accepted_tokens[: plan.num_decode]
        used_initial_state = torch.ones(n, dtype=torch.bool, device=dev)
        if recurrent.prefill is not None:
            used_initial_state[plan.num_decode: shape.num_reqs] = recurrent.prefill.has_initial_state
        return PreparedStep(qsl, input_ids, positions, seq_lens, slot_mapping, attn, recurrent,
                            st.draft_tokens[rows.idx].clone(), used_accepted, used_initial_state)

    def run(self, step: PreparedStep) -> torch.Tensor:
        ctx = ForwardContext(attn=step.attn, recurrent=step.recurrent, kv_caches=self.caches.kv,
                             states=self.caches.states,
                             recurrent_prefill_chunked=self.recurrent_prefill_chunked)
        return self.model(step.input_ids, step.positions, ctx)

    def verify(self, plan: StepPlan, rows: TargetRows, step: PreparedStep, hidden: torch.Tensor) -> Verified:
        """Greedy verification; index arithmetic from host facts, so nothing is read back."""
        n, dev = plan.shape.num_reqs, self.device
        sampling = plan.sampling_rows
        s_rows = _host_index(sampling, dev)
        counts = rows.num_drafts[s_rows] + 1
        total = sum(1 + len(plan.rows[i].draft_token_ids) for i in sampling)
        cu = torch.zeros(s_rows.numel() + 1, dtype=torch.int64, device=dev)
        cu[1:] = counts.cumsum(0)
        starts = step.qsl[s_rows + 1].long() - counts  # each sampling row's last committed token
        offsets = torch.arange(total, device=dev) - torch.repeat_interleave(cu[:-1], counts, output_size=total)
        logit_idx = torch.repeat_interleave(starts, counts, output_size=total) + offsets
        logits = self.model.compute_logits(hidden[logit_idx])
        tokens, num_valid = kernels.greedy_verify(logits, step.prev_drafts[s_rows],
                                                  rows.num_drafts[s_rows].to(torch.int32), cu.to(torch.int32))
        sampled = torch.full((n, self.k + 1), -1, dtype=torch.int64, device=dev)
        sampled[s_rows] = tokens
        valid = torch.ones(n, dtype=torch.int32, device=dev)
        valid[s_rows] = num_valid
        return Verified(s_rows, cu, logits, sampled, valid)

    def commit(self, rows: TargetRows, v: Verified) -> None:
        st = self.state
        post_update(idx_mapping=rows.idx.to(torch.int32), query_lens=rows.query_len.to(torch.int32),
                    num_draft_tokens=rows.num_drafts.to(torch.int32), is_sampling=rows.is_sampling.bool(),
                    sampled=v.sampled, num_valid=v.num_valid, num_computed=st.num_computed,
                    num_valid_state=st.num_valid, last_sampled=st.last_sampled, token_ids=st.token_ids,
                    num_tokens=st.num_tokens)

    def draft(self, plan: StepPlan, rows: TargetRows, drafter_rows: DrafterRows, step: PreparedStep,
              hidden: torch.Tensor, v: Verified) -> tuple[torch.Tensor, DraftOutputs | None]:
        """Returns the kept positions per row [n] and what the proposer reports (None without one)."""
        q, num_tokens = rows.query_len, plan.qsl[-1]
        if self.proposer is None:
            return q, None
        sampling = drafter_rows.is_sampling.bool()
        rejected = drafter_rows.num_drafts - (v.num_valid.long() - 1)
        kept = q - torch.where(sampling, rejected, torch.zeros_like(q))
        n = plan.shape.num_reqs
        attn = AttnMetadata(step.qsl, step.seq_lens[:n], step.attn.block_table[:n], step.slot_mapping[:num_tokens])
        out = self.proposer.propose(DraftInputs(
            idx=rows.idx, query_start_loc=step.qsl, is_sampling=sampling, sampling_rows=v.sampling_rows,
            backup_token=drafter_rows.backup_token, kept=kept, input_ids=step.input_ids[:num_tokens],
            positions=step.positions[:num_tokens], hidden=hidden[:num_tokens], attn=attn))
        return kept, out


    # ---- FULL steps: the whole program on static padded tables --------------------------------------
    def _uniform_program(self, plan: StepPlan, target: torch.Tensor, fut: StepFuture) -> None:
        """A uniform decode step: every real row a decode of 1+K tokens, padded to Np rows.

        The program from preparation to drafting reads only the static table and persistent state,
        and nothing back to the host, so on CUDA it is one graph per Np; the real rows' tokens are
        copied out afterwards.
        """
        n, n_pad = plan.shape.num_reqs, plan.shape.num_reqs_padded
        tables = self._static_tables(n_pad)
        tables.live["target"][:n] = target
        tables.live["target"][n:] = tables.inert["target"][n:]
        out = self.step_graphs.run(n_pad, tables.live, tables.inert, lambda: self._uniform_step(plan, tables.live))
        t = n * (self.k + 1)
        if self.check_inputs and out["first_pass_ids"] is not None:
            check_vocab_ids(out["first_pass_ids"][:t], out["qsl"], out["idx"], out["positions"][:t],
                            self.vocab_size)
        fut.sampled.copy_(out["sampled"][:n], non_blocking=True)
        fut.num_valid.copy_(out["num_valid"][:n], non_blocking=True)
        if plan.record:
            first, chain = out["first_pass_ids"], out["chain_ids"]
            fut.payload.update(
                input_ids=out["input_ids"][:t].cpu(), positions=out["positions"][:t].cpu(),
                used_accepted=out["used_accepted"][:n].cpu(), prev_drafts=out["prev_drafts"][:n].cpu(),
                used_initial_state=out["used_initial_state"][:n].cpu(),
                logits=out["logits"][:t].cpu(), cu=torch.arange(0, t + 1, self.k + 1),
                sampling_rows=torch.arange(n), kept=out["kept"][:n].cpu(),
                first_pass_ids=None if first is None else first[:t].cpu(),
                chain_ids=None if chain is None else chain[:n].cpu(), next_drafts=out["next_drafts"][:n].cpu(),
                gdn_shapes=out["recurrent_shapes"])

    def _static_tables(self, n_pad: int) -> StaticTables:
        tables = self._static.get(n_pad)
        if tables is None:
            cols = TargetRows.columns()
            inert = torch.zeros(n_pad, len(cols), dtype=torch.int64, device=self.device)
            inert[:, cols.index("idx")] = -1  # a padding row: no request slot, zero tokens, samples nothing
            inert[:, cols.index("is_decode")] = 1
            tables = self._static[n_pad] = StaticTables({"target": inert.clone()}, {"target": inert})
        return tables

    def _uniform_step(self, plan: StepPlan, tables: dict[str, torch.Tensor]) -> dict:
        """Prepare, run, verify, commit and draft over the static table; returns static outputs."""
        k1, dev = self.k + 1, self.device
        rows = TargetRows.view(tables["target"])
        step = self.prepare(plan, rows, self.state.num_computed)
        hidden = self.run(step)
        real = rows.idx >= 0
        n_pad, t_pad = real.shape[0], hidden.shape[0]
        logits = self.model.compute_logits(hidden)  # [Np*(K+1), V]: every row 1+K tokens
        cu = torch.arange(0, t_pad + 1, k1, dtype=torch.int32, device=dev)
        tokens, num_valid = kernels.greedy_verify(logits, step.prev_drafts,
                                                  torch.full((n_pad,), self.k, dtype=torch.int32, device=dev), cu)
        sampled = torch.where(real[:, None], tokens, torch.full_like(tokens, -1))
        num_valid = torch.where(real, num_valid, torch.ones_like(num_valid))
        verified = Verified(torch.arange(n_pad, device=dev), cu.long(), logits, sampled, num_valid)
        self.commit(rows, verified)
        kept = torch.where(real, num_valid.long(), torch.ones_like(rows.idx))
        drafts = None
        if self.proposer is not None:
            drafts = self.proposer.propose_uniform(UniformDraftInputs(
                idx=rows.idx, real=real, kept=kept, input_ids=step.input_ids, positions=step.positions,
                hidden=hidden, attn=step.attn))
        return {"sampled": sampled, "num_valid": num_valid, "input_ids": step.input_ids,
                "positions": step.positions, "used_accepted": step.used_accepted, "prev_drafts": step.prev_drafts,
                "used_initial_state": step.used_initial_state,
                "logits": logits, "kept": kept, "qsl": step.qsl, "idx": rows.idx,
                "first_pass_ids": None if drafts is None else drafts.first_pass_ids,
                "chain_ids": None if drafts is None else drafts.chain_ids,
                "next_drafts": self.state.draft_tokens[rows.idx],
                "recurrent_shapes": {**step.recurrent.shapes(), **attn_shapes("attn", step.attn),
                                     **({} if drafts is None else drafts.metadata_shapes)}}


def _payload(plan: StepPlan, step: PreparedStep, v: Verified, drafts) -> dict:
    """What the step records need, copied to the host (only when observers are attached)."""
    t = plan.qsl[-1]
    kept, out = drafts
    payload = {"input_ids": step.input_ids[:t].cpu(), "positions": step.positions[:t].cpu(),
               "used_accepted": step.used_accepted.cpu(), "used_initial_state": step.used_initial_state.cpu(), "prev_drafts": step.prev_drafts.cpu(),
               "logits": v.logits.cpu(), "cu": v.cu.cpu(), "sampling_rows": v.sampling_rows.cpu(),
               "kept": kept.cpu(), "first_pass_ids": None, "chain_ids": None, "gdn_shapes": step.recurrent.shapes()}
    if out is not None:
        payload["first_pass_ids"] = None if out.first_pass_ids is None else out.first_pass_ids.cpu()
        payload["chain_ids"] = out.chain_ids.cpu()
    return payload


def to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on ``dev`` without making the host wait for the work already queued there.

    A copy from pageable memory blocks the host until the stream reaches it (that is, until the step
    in flight is done); from pinned memory it is queued like any other work.
    """
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t


def _host_index(values: list[int], dev: torch.device) -> torch.Tensor:
    """A small index tensor from host values, copied without waiting for the device."""
    return to_device(torch.tensor(values, dtype=torch.int64), dev)
