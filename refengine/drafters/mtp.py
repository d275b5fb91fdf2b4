"""MTP drafting: the model's multi-token-prediction head proposes K tokens.

First pass: every kept position p of a step pairs the target's hidden state at p with the
committed token at p+1 (so the MTP layer's KV cache covers every committed position); the last
kept position of a sampling row takes the token just sampled, that of a prompt chunk the next
prompt token. Then K-1 chained single-token steps, each feeding the previous draft and the
previous MTP hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import PAD_SLOT_ID
from refengine.drafters.base import (
    DeviceDraftContext,
    DraftInputs,
    DraftOutputs,
    HostDraftContext,
    Proposal,
    attn_shapes,
    first_pass,
)
from refengine.forward_context import AttnMetadata
from refengine.model import MTP_CACHE_KEY


@dataclass
class MTPDrafter:
    num_speculative_tokens: int
    method: str = "mtp"
    uses_kv_cache: bool = True

    def check_model(self, model) -> None:
        if getattr(model, "mtp", None) is None:
            raise ValueError("drafter='mtp' needs a checkpoint with mtp.* weights; this one has none "
                             "(use num_speculative_tokens=0 or drafter='scripted')")

    def host_proposer(self, ctx: HostDraftContext) -> MTPHostProposer:
        return MTPHostProposer(ctx)

    def device_proposer(self, ctx: DeviceDraftContext) -> MTPDeviceProposer:
        return MTPDeviceProposer(ctx)


class MTPHostProposer:
    """The reference engine's MTP drafting, with plain loops over request state."""

    def __init__(self, ctx: HostDraftContext):
        self.ctx = ctx

    def propose(self, outcomes: list, result) -> list[Proposal]:
        ctx, model = self.ctx, self.ctx.model
        dev, kv = ctx.device, ctx.caches.kv[MTP_CACHE_KEY]
        fp = first_pass(outcomes, result)
        proposals, attn_rows = fp.proposals, fp.attn_rows
        if not outcomes:
            return proposals
        positions = torch.tensor(fp.positions, dtype=torch.int64, device=dev)
        ids = torch.tensor(fp.ids, dtype=torch.int64, device=dev)
        hidden = result.hidden[fp.hidden_rows]
        mtp_hidden = model.mtp(ids, hidden, positions, ctx.attn_metadata(attn_rows), kv)
        ends = torch.tensor([len(pos) for _, pos, _ in attn_rows], device=dev).cumsum(0) - 1
        sampling = [i for i, o in enumerate(outcomes) if o.tokens is not None and not o.request.is_finished]
        if not sampling:
            return proposals
        hidden = mtp_hidden[ends[sampling]]
        drafts = [model.compute_logits(hidden).argmax(dim=-1)]
        rows = [(outcomes[i].request, result.num_computed_before[i] + outcomes[i].num_kept) for i in sampling]
        for step in range(1, ctx.num_speculative_tokens):
            prev = drafts[-1]
            chain = []
            for r, computed in rows:
                pos = computed + step - 1  # MTP row p pairs token p+1 with hidden p
                chain.append((r.block_ids, [pos], pos + 1))
            positions = torch.tensor([p[0] for _, p, _ in chain], dtype=torch.int64, device=dev)
            hidden = model.mtp(prev, hidden, positions, ctx.attn_metadata(chain), kv)
            drafts.append(model.compute_logits(hidden).argmax(dim=-1))
            for i, token in zip(sampling, prev.tolist()):
                proposals[i].input_ids.append(token)
        for i, d in zip(sampling, torch.stack(drafts, dim=1).tolist()):
            proposals[i].drafts = d
        return proposals


class MTPDeviceProposer:
    """The async engine's MTP drafting, on the device, from committed tokens only.

    One form for every step: rows that do not sample (prompt chunks, padding) run the chained
    passes inert (no KV write, zero context) and keep their drafts.
    """

    def __init__(self, ctx: DeviceDraftContext):
        self.ctx = ctx

    def stage(self, admitted: list) -> None:
        return None

    def admit(self, idx: torch.Tensor, staged) -> None:
        return None

    def next_token_ids(self, d: DraftInputs) -> torch.Tensor:
        """[Tp] the committed token after each position (filler ids past the kept positions)."""
        st, tp = self.ctx.state, d.num_tokens_padded
        token = torch.arange(tp, device=d.idx.device)
        row = torch.searchsorted(d.query_start_loc[1:], token.to(d.query_start_loc.dtype), right=True)
        r = d.idx[row.clamp(max=d.idx.shape[0] - 1)]  # request slot of each token (tokens past the rows: any)
        nxt_pos = d.positions + 1
        committed = nxt_pos < st.num_tokens[r].long()
        nxt = torch.where(
            committed, st.token_ids[r, nxt_pos.clamp(max=st.token_ids.shape[1] - 1)], d.input_ids
        )
        last = torch.where(d.is_sampling, st.last_sampled[d.idx], d.backup_token)
        out = torch.cat([nxt, nxt.new_zeros(1)])  # one spare entry takes the rows that kept nothing
        out[d.last_kept()] = last
        return out[:tp]

    def propose(self, d: DraftInputs) -> DraftOutputs:
        ctx, model, st = self.ctx, self.ctx.model, self.ctx.state
        k, bs, kv = ctx.num_speculative_tokens, ctx.block_size, ctx.caches.kv[MTP_CACHE_KEY]
        ids = self.next_token_ids(d)
        # Debug mode: the runner refuses an id outside the vocabulary once the program is done (the ids go
        # back as ``first_pass_ids``; a read here would sync inside a captured graph); until then the head
        # is fed them clamped, so a bad id reads no memory outside the embedding.
        fed = ids.clamp(0, ctx.vocab_size - 1) if ctx.check_inputs else ids
        mtp_hidden = model.mtp(fed, d.hidden, d.positions, d.attn, kv, piece_graphs=d.pieces, name="mtp")
        hidden = mtp_hidden[d.last_kept().clamp(max=d.num_tokens_padded - 1)]  # [Np]
        drafts = [model.compute_logits(hidden).argmax(dim=-1)]
        live = d.is_sampling
        base = st.num_computed[d.idx].long()  # committed after this step's post-update
        qsl = torch.zeros(d.idx.shape[0] + 1, dtype=torch.int32, device=d.idx.device)
        qsl[1:] = live.to(torch.int32).cumsum(0)  # one token per sampling row; other rows repeat it
        # The chained passes' token axis: sampling rows first, in row order, so a sampling row's token
        # sits where ``qsl`` says (its rank among the sampling rows) even when a prompt chunk precedes it.
        order = torch.argsort((~live).to(torch.int32), stable=True)  # [Np] token t -> row
        rank = torch.argsort(order)  # [Np] row -> its token
        table_rows = torch.where(live[:, None], st.block_table[d.idx], st.sink_block)
        shapes = attn_shapes("drafter", d.attn)
        for step in range(1, k):
            pos = base + step - 1  # MTP row p pairs token p+1 with hidden p
            blocks = st.block_table[d.idx, (pos // bs).clamp(max=st.block_table.shape[1] - 1)].long()
            slots = torch.where(live, blocks * bs + pos % bs, torch.full_like(pos, PAD_SLOT_ID))
            seq_lens = torch.where(live, pos + 1, torch.zeros_like(pos)).to(torch.int32)
            attn = AttnMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_table=table_rows,
                                slot_mapping=slots[order])
            shapes.update(attn_shapes("drafter_chain", attn))
            hidden = model.mtp(drafts[-1][order], hidden[order], pos[order], attn, kv, piece_graphs=d.pieces,
                               name=f"mtp-chain{step}")[rank]
            drafts.append(model.compute_logits(hidden).argmax(dim=-1))
        table = torch.stack(drafts, dim=1)
        return DraftOutputs(table, ids, table[:, :-1], shapes)
