"""EAGLE-1 and EAGLE-3 drafting: a head of its own (``draft_model``, vLLM's layout) proposes K tokens.

Structurally MTP drafting (``refengine.drafters.mtp``) with another head: the head keeps a KV cache of its
own (``eagle.{i}``, declared through ``cache_specs``); a first pass over every kept position p of a step
pairs the target's state at p with the committed token at p+1 (the last kept position of a sampling row
takes the token just sampled, that of a prompt chunk the next prompt token), so the head's KV covers every
committed position; then K-1 chained single-token passes at positions p+1, p+2, ..., each fed the previous
draft and the head's own second output (EAGLE-3: its pre-norm state).

The state at p is what the head reads: EAGLE-1 the target's final (normed) hidden state, EAGLE-3 ``fc`` over
the target's auxiliary states (the residual stream after each layer of ``aux_layers``), which both runners
capture when the drafter names ``aux_layers``.

With prefix caching the head's KV at a block's last position depends on the token after the block, so a
hit drops the last matched block (vLLM's rule for EAGLE-style drafters, ``drops_last_block``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

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
from refengine.drafters.mtp import MTPDeviceProposer
from refengine.forward_context import AttnMetadata
from refengine.model.eagle import EagleHeadConfig, EagleHeadError, head_cache_specs, load_eagle_head
from refengine.model.loader import TINY_NAME_PREFIX, tiny_name_message


def resolve_head_path(draft_model: str | os.PathLike) -> str:
    """The head's folder, as given; a tiny model's name (``tiny:eagle3``) is refused (the tools find its
    head: ``refengine.tools.tiny_models.tiny_head_path``)."""
    if str(draft_model).startswith(TINY_NAME_PREFIX):
        raise EagleHeadError(tiny_name_message("draft_model", str(draft_model), "tiny_head_path"))
    return str(draft_model)


@dataclass
class EagleDrafter:
    """``method``: "eagle" | "eagle3"; ``draft_model``: the head's folder. The head is loaded onto the
    target's device and dtype by ``check_model`` (each engine builds its own drafter)."""

    method: str
    num_speculative_tokens: int
    draft_model: str
    uses_kv_cache: bool = False  # not the target family's MTP cache: the head declares its own (cache_specs)
    drops_last_block: bool = True  # prefix caching: a hit drops its last matched block (vLLM's use_eagle)
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: target layers whose input the runners capture
    head: object = field(default=None, repr=False)
    head_config: EagleHeadConfig = field(init=False, repr=False)

    def __post_init__(self):
        self.draft_model = resolve_head_path(self.draft_model)
        self.head_config = EagleHeadConfig.read(self.draft_model, self.method)

    def cache_specs(self, target_cfg, num_speculative_tokens: int) -> dict:
        return head_cache_specs(self.head_config)

    def check_model(self, model) -> None:
        self.head, self.aux_layers = load_eagle_head(self.draft_model, self.method, model, model.config)

    def host_proposer(self, ctx: HostDraftContext) -> EagleHostProposer:
        return EagleHostProposer(ctx, self.head)

    def device_proposer(self, ctx: DeviceDraftContext) -> EagleDeviceProposer:
        return EagleDeviceProposer(ctx, self.head, self.aux_layers)


class EagleHostProposer:
    """The reference engine's EAGLE drafting, with plain loops over request state."""

    def __init__(self, ctx: HostDraftContext, head):
        self.ctx = ctx
        self.head = head

    def propose(self, outcomes: list, result) -> list[Proposal]:
        ctx, head, dev = self.ctx, self.head, self.ctx.device
        kv = ctx.caches.kv
        fp = first_pass(outcomes, result)
        proposals, attn_rows = fp.proposals, fp.attn_rows
        if not outcomes:
            return proposals
        positions = torch.tensor(fp.positions, dtype=torch.int64, device=dev)
        rows = torch.tensor(fp.hidden_rows, dtype=torch.int64, device=dev)
        aux = None if result.aux_hidden is None else result.aux_hidden[rows]
        hidden_in = head.first_hidden(result.hidden[rows], aux)
        ids = torch.tensor(fp.ids, dtype=torch.int64, device=dev)
        for_logits, for_chain = head(ids, hidden_in, positions, ctx.attn_metadata(attn_rows), kv)
        ends = torch.tensor([len(pos) for _, pos, _ in attn_rows], device=dev).cumsum(0) - 1
        sampling = [i for i, o in enumerate(outcomes) if o.tokens is not None and not o.request.is_finished]
        if not sampling:
            return proposals
        drafts = [head.draft(for_logits[ends[sampling]])]
        hidden = for_chain[ends[sampling]]
        reqs = [(outcomes[i].request, result.num_computed_before[i] + outcomes[i].num_kept) for i in sampling]
        for step in range(1, ctx.num_speculative_tokens):
            prev = drafts[-1]
            chain = [(r.block_ids, [computed + step - 1], computed + step) for r, computed in reqs]
            positions = torch.tensor([p[0] for _, p, _ in chain], dtype=torch.int64, device=dev)
            for_logits, hidden = head(prev, hidden, positions, ctx.attn_metadata(chain), kv)
            drafts.append(head.draft(for_logits))
            for i, token in zip(sampling, prev.tolist()):
                proposals[i].input_ids.append(token)
        for i, d in zip(sampling, torch.stack(drafts, dim=1).tolist()):
            proposals[i].drafts = d
        return proposals


class EagleDeviceProposer(MTPDeviceProposer):
    """The async engine's EAGLE drafting, on the device, from committed tokens only; the same form as MTP's
    (rows that do not sample run the chained passes inert: no KV write, zero context)."""

    def __init__(self, ctx: DeviceDraftContext, head, aux_layers: tuple[int, ...]):
        super().__init__(ctx)
        self.head = head
        self.aux_layers = aux_layers  # the async runner captures these layers' input for ``aux_hidden``

    def chain_positions(self, d: DraftInputs) -> torch.Tensor:
        """[Np] each row's committed count after this step: the first chained pass runs at that position."""
        return self.ctx.state.num_computed[d.idx].long()

    def chain_hidden(self, d: DraftInputs, for_chain: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """[Np, H] what the first chained pass is fed: the head's own second output at each row's last kept
        position (``for_chain`` [Tp, H], ``last`` [Np])."""
        return for_chain[last]

    def propose(self, d: DraftInputs) -> DraftOutputs:
        ctx, head, st = self.ctx, self.head, self.ctx.state
        k, bs, kv = ctx.num_speculative_tokens, ctx.block_size, ctx.caches.kv
        ids = self.next_token_ids(d)
        # Debug mode: ids go back as ``first_pass_ids`` for the runner to refuse; the head reads them clamped.
        fed = ids.clamp(0, ctx.vocab_size - 1) if ctx.check_inputs else ids
        for_logits, for_chain = head(fed, head.first_hidden(d.hidden, d.aux_hidden), d.positions, d.attn, kv)
        last = d.last_kept().clamp(max=d.num_tokens_padded - 1)  # [Np]
        drafts = [head.draft(for_logits[last])]
        hidden = self.chain_hidden(d, for_chain, last)
        live = d.is_sampling
        base = self.chain_positions(d)
        qsl = torch.zeros(d.idx.shape[0] + 1, dtype=torch.int32, device=d.idx.device)
        qsl[1:] = live.to(torch.int32).cumsum(0)  # one token per sampling row; other rows repeat it
        order = torch.argsort((~live).to(torch.int32), stable=True)  # [Np] token t -> row, sampling first
        rank = torch.argsort(order)  # [Np] row -> its token
        table_rows = torch.where(live[:, None], st.block_table[d.idx], st.sink_block)
        shapes = attn_shapes("drafter", d.attn)
        for step in range(1, k):
            pos = base + step - 1
            blocks = st.block_table[d.idx, (pos // bs).clamp(max=st.block_table.shape[1] - 1)].long()
            slots = torch.where(live, blocks * bs + pos % bs, torch.full_like(pos, PAD_SLOT_ID))
            seq_lens = torch.where(live, pos + 1, torch.zeros_like(pos)).to(torch.int32)
            attn = AttnMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_table=table_rows,
                                slot_mapping=slots[order])
            shapes.update(attn_shapes("drafter_chain", attn))
            for_logits, hidden = head(drafts[-1][order], hidden[order], pos[order], attn, kv)
            for_logits, hidden = for_logits[rank], hidden[rank]
            drafts.append(head.draft(for_logits))
        table = torch.stack(drafts, dim=1)
        return DraftOutputs(table, ids, table[:, :-1], shapes)
