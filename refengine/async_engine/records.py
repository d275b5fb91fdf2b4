"""Observer records of an async step, assembled on the host from the step's payload."""

from __future__ import annotations

import torch

from refengine.outputs import RowRecord, logits_digest


def build_records(plan, tokens: list[list[int]], drafted: list[int], payload,
                  num_speculative_tokens: int) -> list[RowRecord]:
    """One ``RowRecord`` per real row of ``plan``; ``drafted``: the drafts each row verified (a decode row
    runs K draft positions, of which the drafter may have filled fewer); ``payload`` is its ``StepPayload``.

    A row's drafts and logits digest cover what was verified, the first 1 + drafted logits rows, as
    the reference engine's do.
    """
    p = payload
    ids, positions = p.input_ids.tolist(), p.positions.tolist()
    used_num_valid, prev_drafts = p.used_num_valid.tolist(), p.prev_drafts.tolist()
    used_initial_state, next_drafts, kept = (
        p.used_initial_state.tolist(),
        p.next_drafts.tolist(),
        p.kept.tolist(),
    )
    next_num_drafts = p.next_num_drafts.tolist()
    cu = p.cu.tolist()
    first_pass = p.first_pass_ids.tolist() if p.first_pass_ids is not None else None
    chain_rows = p.chain_ids.tolist() if p.chain_ids is not None else None
    records = []
    for i, row in enumerate(plan.rows):
        lo, hi = plan.qsl[i], plan.qsl[i + 1]
        decode = i < plan.num_decode
        has_init = bool(used_initial_state[i])  # as handed to the recurrent kernels
        slots = plan.slots[i]
        if decode:
            offset = used_num_valid[i] - 1  # as handed to the recurrent kernels
            slot = slots[offset]
        else:
            offset, slot = 0, (slots[0] if has_init else None)
        rec = RowRecord(
            request_id=row.request.request_id,
            kind="decode" if decode else "prefill",
            has_initial_state=has_init,
            num_computed_tokens=positions[lo] if hi > lo else 0,
            query_len=hi - lo,
            input_ids=ids[lo:hi],
            positions=positions[lo:hi],
            state_slot_read=slot,
            state_offset=offset,
            draft_token_ids=prev_drafts[i][: drafted[i]] if decode else [],
            output_token_ids=None,
            num_accepted=None,
        )
        if row.samples:
            row_logits = p.logits[cu[i]: cu[i] + 1 + drafted[i]]
            rec.output_token_ids = tokens[i]
            rec.num_accepted = len(tokens[i]) - 1
            rec.logits_digest = logits_digest(row_logits)
            rec.logits_finite = bool(torch.isfinite(row_logits).all())
            if num_speculative_tokens:
                rec.next_draft_token_ids = next_drafts[i][: next_num_drafts[i]]
        if first_pass is not None:
            rec.drafter_input_ids = first_pass[lo: lo + kept[i]]
        if row.samples and chain_rows is not None:
            rec.drafter_input_ids += chain_rows[i]
        records.append(rec)
    return records
