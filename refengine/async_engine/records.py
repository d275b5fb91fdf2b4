"""Observer records of an async step, assembled on the host from the step's device payload."""

from __future__ import annotations

import torch

from refengine.outputs import RowRecord, logits_digest


def build_records(plan, tokens: list[list[int]], payload: dict, k: int) -> list[RowRecord]:
    ids, positions = payload["input_ids"].tolist(), payload["positions"].tolist()
    used_accepted, prev_drafts = payload["used_accepted"].tolist(), payload["prev_drafts"].tolist()
    used_initial_state = payload["used_initial_state"].tolist()
    next_drafts = payload["next_drafts"].tolist()
    kept = payload["kept"].tolist()
    sampling = payload["sampling_rows"].tolist()
    cu, logits = payload["cu"].tolist(), payload["logits"]
    first = payload["first_pass_ids"]
    chain = payload["chain_ids"]
    first_pass = first.tolist() if first is not None else None
    chain_rows = chain.tolist() if chain is not None else None
    records = []
    for i, row in enumerate(plan.rows):
        req = row.request
        lo, hi = plan.qsl[i], plan.qsl[i + 1]
        decode = i < plan.num_decode
        samples = i in sampling
        has_init = bool(used_initial_state[i])  # as handed to the GDN kernels
        slots = plan.slots[i]
        if decode:
            offset = used_accepted[i] - 1  # as handed to the GDN kernels
            slot = slots[offset]
        else:
            offset, slot = 0, (slots[0] if has_init else None)
        rec = RowRecord(
            request_id=req.request_id, kind="decode" if decode else "prefill", has_initial_state=has_init,
            num_computed_tokens=positions[lo] if hi > lo else 0, query_len=hi - lo, input_ids=ids[lo:hi],
            positions=positions[lo:hi], state_slot_read=slot, state_offset=offset,
            draft_token_ids=prev_drafts[i][: len(row.draft_token_ids)] if decode else [],
            output_token_ids=None, num_accepted=None)
        if samples:
            j = sampling.index(i)
            rec.output_token_ids = tokens[i]
            rec.num_accepted = len(tokens[i]) - 1
            rec.logits_digest = logits_digest(logits[cu[j]: cu[j + 1]])
            rec.logits_finite = bool(torch.isfinite(logits[cu[j]: cu[j + 1]]).all())
            if k:
                rec.next_draft_token_ids = next_drafts[i]
        if first_pass is not None:
            rec.drafter_input_ids = first_pass[lo: lo + kept[i]]
        if samples and chain_rows is not None:
            rec.drafter_input_ids += chain_rows[sampling.index(i)]
        records.append(rec)
    return records
