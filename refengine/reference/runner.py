"""The reference runner: rebuilds every step's inputs from request state with plain loops.

No persistent batch, no graphs, no device-side state: each step reads the requests, builds the
tensors the model needs, runs the model, verifies drafts greedily, and (after the engine has
committed the step's tokens) proposes the next drafts. What it does defines correct behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import kernels
from refengine.cache import ModelCaches
from refengine.drafters import Drafter, HostDraftContext, Proposal
from refengine.forward_context import AttnMetadata, ForwardContext, RecurrentGroup, RecurrentMetadata
from refengine.grammar import apply_bitmask
from refengine.logits_process import process, prompt_logprob_span, raw_logprobs, top_logprobs
from refengine.outputs import RowRecord, logits_digest
from refengine.sampling import RowParams
from refengine.sampling import verify as sampling_verify
from refengine.scheduler import ScheduledRow, SchedulerOutput


@dataclass
class StepResult:
    valid_tokens: list[
        list[int] | None
    ]  # per row: verifier output (valid tokens), None for a partial prefill
    records: list[RowRecord]  # per row, for observers
    hidden: torch.Tensor  # [T, H] post-norm hidden states (the MTP's input)
    query_start: list[int]  # per row: first token index in the flat token axis
    num_computed_before: list[int]  # per row: num_computed_tokens when the step was scheduled
    block_ids: list[list[int]]  # per row: the request's KV blocks during the step (a request that finishes
    #                             in it gives them back, but the step's protocol holds them until published)
    metadata_shapes: dict = field(default_factory=dict)
    # per row: (top values, top ids, chosen logprob) per kept token, for rows whose request asks for logprobs
    logprobs: list = field(default_factory=list)
    # per row: (first prompt index, entries) for prompt chunks of requests asking prompt logprobs, else None
    prompt_logprobs: list = field(default_factory=list)
    state_slots: list[list[int]] = field(default_factory=list)  # per row: the request's s_0..s_K in the step
    aux_hidden: torch.Tensor | None = None  # [T, n*H] the drafter's aux_layers states (EAGLE-3), else None


class _GroupBuilder:
    """Collects the rows of one recurrent group (prefill or decode) with plain lists."""

    def __init__(self):
        self.token_indices: list[int] = []
        self.query_start_loc: list[int] = [0]
        self.state_indices: list = []
        self.has_initial_state: list[bool] = []
        self.num_valid: list[int] = []

    def add(self, token_range: range, state_index, has_initial_state: bool, num_valid: int) -> None:
        self.token_indices.extend(token_range)
        self.query_start_loc.append(len(self.token_indices))
        self.state_indices.append(state_index)
        self.has_initial_state.append(has_initial_state)
        self.num_valid.append(num_valid)

    def build(self, device, speculative: bool, prefill: bool) -> RecurrentGroup | None:
        if not self.state_indices:
            return None
        i32 = {"dtype": torch.int32, "device": device}
        return RecurrentGroup(
            token_indices=torch.tensor(self.token_indices, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(self.query_start_loc, **i32),
            state_indices=torch.tensor(self.state_indices, **i32),
            has_initial_state=torch.tensor(self.has_initial_state, dtype=torch.bool, device=device)
            if prefill else None,
            num_valid=torch.tensor(self.num_valid, **i32) if speculative and not prefill else None,
        )


class ReferenceRunner:
    def __init__(self, model, caches: ModelCaches, *, block_size: int, num_speculative_tokens: int,
                 drafter: Drafter | None, recurrent_prefill_chunked: bool, device):
        self.model = model
        self.caches = caches
        self.block_size = block_size
        self.num_speculative_tokens = num_speculative_tokens
        self.recurrent_prefill_chunked = recurrent_prefill_chunked
        self.device = torch.device(device)
        self.aux_layers = tuple(getattr(drafter, "aux_layers", ()))  # target layers the drafter reads
        self.proposer = None if drafter is None else drafter.host_proposer(
            HostDraftContext(model, caches, self.device, num_speculative_tokens, self._attn_metadata,
                             block_size, recurrent_prefill_chunked))

    # ---- step inputs ------------------------------------------------------------------------
    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _attn_metadata(self, rows: list[tuple[list[int], list[int], int]]) -> AttnMetadata:
        """``rows``: (block_ids, positions, seq_len) per row."""
        width = max(len(b) for b, _, _ in rows)
        qsl, seq_lens, slots, table = [0], [], [], []
        for block_ids, positions, seq_len in rows:
            qsl.append(qsl[-1] + len(positions))
            seq_lens.append(seq_len)
            slots.extend(self._slot(block_ids, p) for p in positions)
            table.append(block_ids + [self.caches.sink_block] * (width - len(block_ids)))
        dev = self.device
        return AttnMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        )

    def _context(self, attn: AttnMetadata, recurrent: RecurrentMetadata) -> ForwardContext:
        return ForwardContext(
            attn=attn,
            recurrent=recurrent,
            kv_caches=self.caches.kv,
            states=self.caches.states,
            recurrent_prefill_chunked=self.recurrent_prefill_chunked,
        )

    # ---- one step ---------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput, record_digests: bool = False) -> StepResult:
        input_ids: list[int] = []
        positions: list[int] = []
        attn_rows, records, query_start, computed = [], [], [], []
        prefill, decode = _GroupBuilder(), _GroupBuilder()
        speculative = self.num_speculative_tokens > 0
        for row in sched.rows:
            req = row.request
            nc = req.num_computed_tokens
            toks = req.all_token_ids[nc: nc + row.num_committed] + row.draft_token_ids
            pos = list(range(nc, nc + row.num_tokens))
            start = len(input_ids)
            input_ids += toks
            positions += pos
            attn_rows.append((req.block_ids, pos, nc + row.num_tokens))
            query_start.append(start)
            computed.append(nc)
            tokens = range(start, start + row.num_tokens)
            if req.is_prefilling:  # contract 2: zero initial state iff nothing computed yet
                prefill.add(tokens, req.state_slots[0], req.has_initial_state, 1)
                slot_read, offset = (req.state_slots[0] if req.has_initial_state else None), 0
            else:
                offset = req.num_valid - 1  # contract 1: live state is s_{a-1}
                decode.add(
                    tokens, req.state_slots if speculative else req.state_slots[0], True, req.num_valid
                )
                slot_read = req.state_slots[offset]
            records.append(RowRecord(
                request_id=req.request_id, kind="prefill" if req.is_prefilling else "decode",
                has_initial_state=req.has_initial_state, num_computed_tokens=nc, query_len=row.num_tokens,
                input_ids=toks, positions=pos, state_slot_read=slot_read, state_offset=offset,
                draft_token_ids=list(row.draft_token_ids), output_token_ids=None, num_accepted=None))

        dev = self.device
        recurrent = RecurrentMetadata(prefill=prefill.build(dev, speculative, prefill=True),
                                      decode=decode.build(dev, speculative, prefill=False))
        ctx = self._context(self._attn_metadata(attn_rows), recurrent)
        ctx.aux_layers = self.aux_layers
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        hidden = self.model(ids, torch.tensor(positions, dtype=torch.int64, device=dev), ctx)
        aux = ctx.aux_hidden_states() if self.aux_layers else None

        digests: list[str | None] = [None] * len(sched.rows)
        logprobs: list = [None] * len(sched.rows)
        valid = self._verify(sched.rows, query_start, hidden, digests if record_digests else None, logprobs)
        for rec, v, d in zip(records, valid, digests):
            if v is not None:
                rec.output_token_ids = v
                rec.num_accepted = len(v) - 1
                rec.logits_digest, rec.logits_finite = d if d is not None else (None, None)
        blocks = [list(row.request.block_ids) for row in sched.rows]
        prompt = self._prompt_logprobs(sched.rows, query_start, computed, hidden)
        return StepResult(valid, records, hidden, query_start, computed, blocks, recurrent.shapes(), logprobs,
                          prompt, state_slots=[list(row.request.state_slots) for row in sched.rows],
                          aux_hidden=aux)

    def _prompt_logprobs(self, rows: list[ScheduledRow], query_start: list[int], computed: list[int],
                         hidden) -> list:
        """Per row: the prompt logprobs its chunk yields (``logits_process.prompt_logprob_span``), from the
        raw log-softmax of the target's logits at each position (never processed), or None."""
        out: list = [None] * len(rows)
        spans = {}
        for i, row in enumerate(rows):
            if row.request.is_prefilling:
                span = prompt_logprob_span(row.request, computed[i], row.num_tokens)
                if span is not None:
                    spans[i] = span
        if not spans:
            return out
        at = [query_start[i] + j for i, (_, count) in spans.items() for j in range(count)]
        targets = [rows[i].request.prompt_token_ids[first + j] for i, (first, count) in spans.items()
                   for j in range(count)]
        raw = raw_logprobs(self.model.compute_logits(hidden[torch.tensor(at, device=self.device)]))
        values, ids = (t.tolist() for t in top_logprobs(raw))
        chosen = raw[torch.arange(len(at), device=self.device), torch.tensor(targets, device=self.device)]
        chosen = chosen.tolist()
        k = 0
        for i, (first, count) in spans.items():
            out[i] = (first, [(values[k + j], ids[k + j], chosen[k + j]) for j in range(count)])
            k += count
        return out

    def _verify(self, rows: list[ScheduledRow], query_start: list[int], hidden,
                digests: list | None, logprobs: list) -> list[list[int] | None]:
        """Verification of each sampling row's last committed token and drafts, on the logits each
        position's grammar mask (``grammar.window_bitmask``) and processors left
        (``logits_process.process``), position j seeing drafts 0..j-1 as decoded: greedy, or seeded
        rejection sampling for requests with a temperature (``sampling``); ``logprobs`` gets the raw
        logprobs of every kept token of rows that ask for them."""
        sampling = [i for i, r in enumerate(rows) if r.samples]
        out: list[list[int] | None] = [None] * len(rows)
        if not sampling:
            return out
        logit_rows, cu, drafts, num_drafts = [], [0], [], []
        k = self.num_speculative_tokens
        for i in sampling:
            row = rows[i]
            first = query_start[i] + row.num_committed - 1  # the last committed token
            logit_rows.extend(range(first, query_start[i] + row.num_tokens))
            cu.append(len(logit_rows))
            drafts.append(row.draft_token_ids + [0] * (k - len(row.draft_token_ids)))
            num_drafts.append(len(row.draft_token_ids))
        dev = self.device
        logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=dev)])
        masked = logits  # the grammar's masks first (vLLM applies the bitmask before its sampler)
        for j, i in enumerate(sampling):
            req, drafts_i = rows[i].request, rows[i].draft_token_ids
            if req.grammar is not None:  # position p: the grammar after drafts 0..p-1 (rolled back after)
                if masked is logits:
                    masked = logits.clone()
                bitmask = req.grammar.window_bitmask(drafts_i).to(dev)
                masked[cu[j]: cu[j + 1]] = apply_bitmask(logits[cu[j]: cu[j + 1]], bitmask)
        processed = masked
        for j, i in enumerate(sampling):
            req, drafts_i = rows[i].request, rows[i].draft_token_ids
            if not req.processors.active:
                continue
            if processed is logits or processed is masked:
                processed = masked.clone()
            for pos in range(len(drafts_i) + 1):  # as if the drafts before it had been decoded
                processed[cu[j] + pos] = process(masked[cu[j] + pos], req.processors, req.prompt_token_ids,
                                                 req.output_token_ids + drafts_i[:pos])
        verify_args = (
            processed,
            torch.tensor(drafts, dtype=torch.int64, device=dev).reshape(len(sampling), k),
            torch.tensor(num_drafts, dtype=torch.int32, device=dev),
            torch.tensor(cu, dtype=torch.int32, device=dev),
        )
        reqs = [rows[i].request for i in sampling]
        if any(r.params.samples for r in reqs):  # seeded rejection sampling (greedy rows stay argmax)
            first = [r.num_computed_tokens + rows[i].num_committed for i, r in zip(sampling, reqs)]
            tokens, num_valid = sampling_verify(
                *verify_args, RowParams.of([r.params for r in reqs], [r.seed for r in reqs], dev),
                torch.tensor(first, dtype=torch.int64, device=dev))
        else:
            tokens, num_valid = kernels.greedy_verify(*verify_args)
        tokens, num_valid = tokens.tolist(), num_valid.tolist()
        wanted = [j for j, i in enumerate(sampling) if rows[i].request.params.logprobs is not None]
        if wanted:
            raw = raw_logprobs(logits)
            top_values, top_ids = (t.tolist() for t in top_logprobs(raw))
        for j, i in enumerate(sampling):
            out[i] = tokens[j][: num_valid[j]]
            if j in wanted:
                logprobs[i] = [(top_values[cu[j] + pos], top_ids[cu[j] + pos], float(raw[cu[j] + pos, t]))
                               for pos, t in enumerate(out[i])]
            if digests is not None:
                row_logits = logits[cu[j]: cu[j + 1]]
                digests[i] = (logits_digest(row_logits), bool(torch.isfinite(row_logits).all()))
        return out

    # ---- drafting (after the engine committed the step) -----------------------------------------
    def propose(self, outcomes: list, result: StepResult) -> list[Proposal | None]:
        """The next drafts of every row that sampled and is still running (``outcomes``: the step's
        ``RowOutcome``s, committed); nothing is written here."""
        if self.proposer is None:
            return [None] * len(outcomes)
        return self.proposer.propose(outcomes, result)
