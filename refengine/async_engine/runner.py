"""The async runner: turns a host step plan into one program on the device timeline.

The program stages the plan's writes, prepares inputs on the device, builds the (padded)
metadata, runs the model, verifies greedily, commits on the device, drafts, and copies the
sampled tokens back. The host gets a future and goes on scheduling the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels
from kernels.input_prep import post_update, prepare_inputs
from refengine.async_engine.drafting import DeviceDrafter, DraftInputs
from refengine.async_engine.graphs import CudaGraphs, StepShape
from refengine.async_engine.metadata import MetadataBuilder, StepTensors, pad_qsl, pad_rows
from refengine.async_engine.stream import Event, HostBuffer, Stream
from refengine.forward_context import AttnMetadata, ForwardContext

# Columns of the per-row metadata the host stages for the target and for the drafter.
META_IDX, META_Q, META_DECODE, META_HAS_INIT, META_SAMPLING, META_DRAFTS = range(6)
DMETA_SAMPLING, DMETA_DRAFTS, DMETA_BACKUP = range(3)


@dataclass
class Admission:
    idx: torch.Tensor  # [n] int64 request slots
    token_rows: torch.Tensor  # [n, L] int64, committed tokens then -1
    num_tokens: torch.Tensor  # [n] int32
    num_prompt: torch.Tensor  # [n] int32
    slots: torch.Tensor  # [n, K+1] int32
    truth: torch.Tensor | None = None  # [n, Lt] int64 (scripted drafter)
    num_correct: torch.Tensor | None = None  # [n, Lt] int32 (scripted drafter)


@dataclass
class StepPlan:
    index: int
    rows: list  # ScheduledRow, in batch order
    shape: StepShape
    num_decode: int
    qsl: list[int]  # [N+1] host query_start_loc (query lengths are scheduling facts, not device state)
    target_meta: HostBuffer  # [N, 6] int64
    drafter_meta: HostBuffer  # [N, 3] int64
    samples: list[bool]  # per row: reaches its last committed token (snapshot at scheduling time)
    slots: list[list[int]]  # per row: the request's GDN slots s_0..s_K (snapshot)
    host_num_computed: list[int]  # per row: the host's optimistic mirror; never an input (DESIGN §4.4)
    host_num_accepted: list[int]  # per row: the host's stale mirror of accepted counts; never an input (§4.3)
    admission: Admission | None = None
    block_idx: torch.Tensor | None = None  # [m] int64 request slots whose block rows changed
    block_rows: torch.Tensor | None = None  # [m, B] int32
    record: bool = False


@dataclass
class StepFuture:
    plan: StepPlan
    event: Event
    sampled: torch.Tensor  # [N, K+1] host, valid tokens then -1
    num_valid: torch.Tensor  # [N] host
    payload: dict = field(default_factory=dict)  # observer data, filled on the device timeline

    def result(self) -> tuple[list[list[int]], dict]:
        self.event.wait()
        tokens, counts = self.sampled.tolist(), self.num_valid.tolist()
        return [t[:c] for t, c in zip(tokens, counts)], self.payload


class AsyncRunner:
    def __init__(self, model, caches, state, stream: Stream, builder: MetadataBuilder, drafter: DeviceDrafter | None,
                 *, block_size: int, num_spec_tokens: int, gdn_prefill_chunked: bool):
        self.model = model
        self.caches = caches
        self.state = state
        self.stream = stream
        self.builder = builder
        self.drafter = drafter
        self.block_size = block_size
        self.k = num_spec_tokens
        self.gdn_prefill_chunked = gdn_prefill_chunked
        self.device = stream.device
        self.graphs = CudaGraphs()  # FULL-mode capture and replay (CUDA only)

    def num_computed_source(self, plan: StepPlan) -> torch.Tensor:
        """Where positions come from: the device's authoritative counts (DESIGN §4.4)."""
        return self.state.num_computed

    def enqueue(self, plan: StepPlan) -> StepFuture:
        n, dev = len(plan.rows), self.device
        tmeta = torch.empty(n, 6, dtype=torch.int64, device=dev)
        self.stream.copy(tmeta, plan.target_meta.tensor[:n, :6], host=plan.target_meta)
        dmeta = torch.empty(n, 3, dtype=torch.int64, device=dev)
        self.stream.copy(dmeta, plan.drafter_meta.tensor[:n, :3], host=plan.drafter_meta)
        fut = StepFuture(plan, None, torch.full((n, self.k + 1), -1, dtype=torch.int64),
                         torch.ones(n, dtype=torch.int64))
        self.stream.submit(lambda: self._program(plan, tmeta, dmeta, fut))
        fut.event = self.stream.record_event()
        return fut

    def _program(self, plan: StepPlan, tmeta: torch.Tensor, dmeta: torch.Tensor, fut: StepFuture) -> None:
        st, shape, dev = self.state, plan.shape, self.device
        if plan.admission is not None:
            a = plan.admission
            st.admit(a.idx.to(dev), a.token_rows.to(dev), a.num_tokens.to(dev), a.num_prompt.to(dev),
                     a.slots.to(dev), _to(a.truth, dev), _to(a.num_correct, dev))
        if plan.block_idx is not None:
            st.block_table[plan.block_idx.to(dev)] = plan.block_rows.to(dev)

        n, num_tokens = shape.num_reqs, plan.qsl[-1]
        idx, q = tmeta[:, META_IDX], tmeta[:, META_Q]
        is_decode, is_sampling = tmeta[:, META_DECODE].bool(), tmeta[:, META_SAMPLING].bool()
        num_draft = tmeta[:, META_DRAFTS]
        qsl = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        qsl[1:] = q.cumsum(0)
        rows_p = shape.num_reqs_padded
        idx_p = pad_rows(idx.to(torch.int32), rows_p, -1)
        qsl_p = pad_qsl(qsl, rows_p)
        is_decode_p = pad_rows(is_decode, rows_p, True)
        input_ids, positions, seq_lens, slot_mapping = prepare_inputs(
            idx_p, qsl_p, is_decode_p, self.num_computed_source(plan), st.last_sampled, st.draft_tokens, st.token_ids,
            st.block_table, self.block_size, shape.num_tokens_padded)
        prev_drafts = st.draft_tokens[idx].clone()
        tensors = StepTensors(idx_p, qsl_p, is_decode_p, pad_rows(tmeta[:, META_HAS_INIT].bool(), rows_p, False),
                              seq_lens, slot_mapping)
        attn, gdn = self.builder.build(tensors, shape, plan.num_decode, plan.qsl, plan.host_num_accepted)
        # The accepted counts the GDN kernels are handed (what decides the state offset each row reads).
        used_accepted = torch.ones(n, dtype=torch.int32, device=dev)
        if gdn.decode is not None and gdn.decode.num_accepted_tokens is not None:
            used_accepted[: plan.num_decode] = gdn.decode.num_accepted_tokens[: plan.num_decode]
        ctx = ForwardContext(attn=attn, gdn=gdn, kv_caches=self.caches.kv, gdn_states=self.caches.gdn,
                             gdn_prefill_chunked=self.gdn_prefill_chunked)
        hidden = self.graphs.run(self.model, input_ids, positions, ctx, shape)

        # Greedy verification of the rows that reach their last committed token.
        s_rows = _host_index([i for i in range(n) if plan.samples[i]], dev)  # no device->host read
        counts = num_draft[s_rows] + 1
        total = sum(1 + len(plan.rows[i].draft_token_ids) for i in range(n) if plan.samples[i])
        cu = torch.zeros(s_rows.numel() + 1, dtype=torch.int64, device=dev)
        cu[1:] = counts.cumsum(0)
        starts = qsl[s_rows + 1].long() - counts
        offsets = torch.arange(total, device=dev) - torch.repeat_interleave(cu[:-1], counts, output_size=total)
        logit_idx = torch.repeat_interleave(starts, counts, output_size=total) + offsets
        logits = self.model.compute_logits(hidden[logit_idx])
        tokens, num_valid = kernels.greedy_verify(logits, prev_drafts[s_rows], num_draft[s_rows].to(torch.int32),
                                                  cu.to(torch.int32))
        sampled = torch.full((n, self.k + 1), -1, dtype=torch.int64, device=dev)
        sampled[s_rows] = tokens
        valid = torch.ones(n, dtype=torch.int32, device=dev)
        valid[s_rows] = num_valid
        post_update(idx.to(torch.int32), q.to(torch.int32), num_draft.to(torch.int32), is_sampling, sampled, valid,
                    st.num_computed, st.num_valid, st.last_sampled, st.token_ids, st.num_tokens)

        draft_ids = chain_ids = None
        if self.drafter is not None:
            kept = q - torch.where(is_sampling, num_draft - (valid.long() - 1), torch.zeros_like(q))
            d_attn = AttnMetadata(qsl, seq_lens[:n], attn.block_table[:n], slot_mapping[:num_tokens])
            draft_ids, chain_ids = self.drafter.propose(DraftInputs(
                idx=idx, query_start_loc=qsl, is_sampling=dmeta[:, DMETA_SAMPLING].bool(), sampling_rows=s_rows,
                backup_token=dmeta[:, DMETA_BACKUP], kept=kept, input_ids=input_ids[:num_tokens],
                positions=positions[:num_tokens], hidden=hidden[:num_tokens], attn=d_attn))

        fut.sampled.copy_(sampled, non_blocking=True)
        fut.num_valid.copy_(valid, non_blocking=True)
        if plan.record:
            fut.payload.update(
                input_ids=input_ids[:num_tokens].cpu(), positions=positions[:num_tokens].cpu(),
                used_accepted=used_accepted.cpu(), prev_drafts=prev_drafts.cpu(), logits=logits.cpu(), cu=cu.cpu(),
                sampling_rows=s_rows.cpu(), kept=(q if draft_ids is None else kept).cpu(),
                draft_ids=None if draft_ids is None else draft_ids.cpu(),
                chain_ids=None if chain_ids is None else chain_ids.cpu(),
                next_drafts=st.draft_tokens[idx].cpu(), gdn_shapes=gdn.shapes())


def _host_index(values: list[int], dev: torch.device) -> torch.Tensor:
    """A small index tensor from host values, copied without waiting for the device."""
    t = torch.tensor(values, dtype=torch.int64)
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t


def _to(x, dev):
    return None if x is None else x.to(dev)
