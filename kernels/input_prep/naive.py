"""Device-side step input preparation and post-step state update (torch references).

Persistent per-request state lives in rows of request-slot tensors (``R`` request slots); a step's
rows map to request slots through ``idx_mapping`` (``-1`` marks a padding row). Nothing here reads
a host copy of per-request state: positions come from the device ``num_computed`` and the input
ids of decode rows from the device's last sampled token and drafts.
"""

from __future__ import annotations

import torch

from kernels.constants import PAD_SLOT_ID
from kernels.input_prep.contract import check_post_update_inputs, check_prepare_inputs_inputs


def naive_prepare_inputs(idx_mapping, query_start_loc, is_decode, num_computed, last_sampled, draft_tokens,
                         token_ids, block_table, block_size: int, num_tokens_padded: int):
    """Build ``input_ids``, ``positions`` [Tp] int64, ``seq_lens`` [N] int32, ``slot_mapping`` [Tp] int64.

    Row i (request slot r = idx_mapping[i], q_i tokens): token j sits at position
    ``num_computed[r] + j``; its id is ``token_ids[r, pos]`` for a prefill row, and for a decode row
    ``last_sampled[r]`` (j = 0) then ``draft_tokens[r, j - 1]``. Padding rows get seq_len 0 and
    tokens past ``query_start_loc[N]`` get id 0, position 0 and ``PAD_SLOT_ID``.
    """
    check_prepare_inputs_inputs(idx_mapping, query_start_loc, is_decode, num_computed, last_sampled,
                                draft_tokens, token_ids, block_table, block_size, num_tokens_padded)
    device = idx_mapping.device
    n = idx_mapping.shape[0]
    qsl = query_start_loc.long()
    num_real = int(qsl[-1])
    input_ids = torch.zeros(num_tokens_padded, dtype=torch.int64, device=device)
    positions = torch.zeros(num_tokens_padded, dtype=torch.int64, device=device)
    slot_mapping = torch.full((num_tokens_padded,), PAD_SLOT_ID, dtype=torch.int64, device=device)
    seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
    if num_real == 0:
        return input_ids, positions, seq_lens, slot_mapping
    q_lens = qsl[1:] - qsl[:-1]  # [N]
    row_of_token = torch.repeat_interleave(torch.arange(n, device=device), q_lens)  # [T]
    j = torch.arange(num_real, device=device) - qsl[row_of_token]  # token index inside its row
    req = idx_mapping.long()[row_of_token]  # [T]
    pos = num_computed.long()[req] + j
    k = draft_tokens.shape[1]
    draft = draft_tokens[req, (j - 1).clamp(0, max(k - 1, 0))] if k else torch.zeros_like(j)
    decode_ids = torch.where(j == 0, last_sampled[req], draft)
    prefill_ids = token_ids[req, pos.clamp(max=token_ids.shape[1] - 1)]
    input_ids[:num_real] = torch.where(is_decode[row_of_token], decode_ids, prefill_ids)
    positions[:num_real] = pos
    blocks = block_table[req, pos // block_size].long()
    slot_mapping[:num_real] = blocks * block_size + pos % block_size
    real = idx_mapping >= 0
    safe = idx_mapping.long().clamp(min=0)
    seq_lens[:] = torch.where(real, num_computed[safe] + q_lens.to(torch.int32), torch.zeros_like(seq_lens))
    return input_ids, positions, seq_lens, slot_mapping


def naive_post_update(idx_mapping, query_lens, num_draft_tokens, is_sampling, sampled, num_valid,
                      num_computed, num_valid_state, last_sampled, token_ids, num_tokens) -> None:
    """Commit a step on the device, in place.

    A sampling row keeps ``num_valid`` tokens: ``num_computed += q - rejected`` with
    ``rejected = num_draft - (num_valid - 1)``, the kept tokens are appended to ``token_ids``, the
    last becomes ``last_sampled`` and ``num_valid_state`` (the next state offset + 1) is
    ``num_valid``. A partial prefill row advances by q and keeps ``num_valid_state`` at 1.
    """
    check_post_update_inputs(idx_mapping, query_lens, num_draft_tokens, is_sampling, sampled, num_valid,
                             num_computed, num_valid_state, last_sampled, token_ids, num_tokens)
    real = idx_mapping >= 0
    rows = torch.nonzero(real).flatten()
    if rows.numel() == 0:
        return
    r = idx_mapping.long()[rows]
    q = query_lens.long()[rows]
    s = is_sampling[rows]
    nv = num_valid.long()[rows]
    rejected = torch.where(s, num_draft_tokens.long()[rows] - (nv - 1), torch.zeros_like(q))
    num_computed[r] += (q - rejected).to(num_computed.dtype)
    num_valid_state[r] = torch.where(s, nv, torch.ones_like(nv)).to(num_valid_state.dtype)
    srows, sr = rows[s], r[s]
    if srows.numel() == 0:
        return
    snv = nv[s]
    last_sampled[sr] = sampled[srows, snv - 1].to(last_sampled.dtype)
    width = sampled.shape[1]
    cols = torch.arange(width, device=sampled.device)
    keep = cols[None, :] < snv[:, None]  # [Ns, K+1]
    base = num_tokens.long()[sr]
    dst_r = sr[:, None].expand(-1, width)[keep]
    dst_c = (base[:, None] + cols[None, :])[keep]
    token_ids[dst_r, dst_c] = sampled[srows][keep].to(token_ids.dtype)
    num_tokens[sr] += snv.to(num_tokens.dtype)
