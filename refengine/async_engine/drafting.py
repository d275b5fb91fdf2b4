"""Drafting on the device, right after verification, from committed tokens only.

MTP: the first pass runs over every token of the step (rejected drafts included as padding; their
outputs are ignored and their MTP KV entries lie past the committed length, overwritten before
anything reads them). Token p is paired with the committed token at p+1 from the device token
table; the last kept position of a sampling row takes the token just sampled, and that of a
prompt chunk the next prompt token (the backup token). Then K-1 chained single-token steps.
Scripted: the true continuation from a device table, right for a scripted number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refengine.forward_context import AttnMetadata


@dataclass
class DraftInputs:
    """What the drafter needs for one step (N real rows, T real tokens)."""

    idx: torch.Tensor  # [N] int64 request slots
    query_start_loc: torch.Tensor  # [N+1] int32
    is_sampling: torch.Tensor  # [N] bool, rows whose logits picked tokens this step
    sampling_rows: torch.Tensor  # [Ns] int64, the indices of those rows
    backup_token: torch.Tensor  # [N] int64, the prompt token after a prompt chunk (host-staged), else -1
    kept: torch.Tensor  # [N] int64, positions of the row now committed
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    hidden: torch.Tensor  # [T, H] target hidden states (post final norm)
    attn: AttnMetadata  # the target's metadata, unpadded


class DrafterInputError(ValueError):
    """An id outside the vocabulary was about to reach the drafter (DESIGN §4.5)."""


class DeviceDrafter:
    def __init__(self, model, caches, state, num_spec_tokens: int, block_size: int, vocab_size: int, kind: str,
                 check_inputs: bool = False):
        self.model = model
        self.caches = caches
        self.state = state
        self.k = num_spec_tokens
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kind = kind  # "mtp" | "scripted"
        self.check_inputs = check_inputs  # debug mode: read the ids back and refuse bad ones (a device sync)

    def next_token_ids(self, d: DraftInputs) -> torch.Tensor:
        """[T] the committed token after each position (filler ids past the kept positions)."""
        st = self.state
        n = d.idx.shape[0]
        q = (d.query_start_loc[1:] - d.query_start_loc[:-1]).long()
        row = torch.repeat_interleave(torch.arange(n, device=d.idx.device), q, output_size=d.input_ids.shape[0])
        r = d.idx[row]
        nxt_pos = d.positions + 1
        committed = nxt_pos < st.num_tokens[r].long()
        nxt = torch.where(committed, st.token_ids[r, nxt_pos.clamp(max=st.token_ids.shape[1] - 1)], d.input_ids)
        last = d.query_start_loc[:-1].long() + d.kept - 1  # [N] last kept token of each row
        nxt[last] = torch.where(d.is_sampling, st.last_sampled[d.idx], d.backup_token)
        return nxt

    def propose(self, d: DraftInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts for the sampling rows into ``state.draft_tokens``; returns (first-pass ids [T], chain ids [Ns, K-1])."""
        sampling = d.sampling_rows
        if self.kind == "scripted":
            return self._scripted(d, sampling)
        st, model = self.state, self.model
        ids = self.next_token_ids(d)
        if self.check_inputs:
            self._check(ids, d)
        mtp_hidden = model.mtp(ids, d.hidden, d.positions, d.attn, self.caches.kv["mtp"])
        if sampling.numel() == 0:
            return ids, ids.new_zeros(0, max(self.k - 1, 0))
        r = d.idx[sampling]
        last = d.query_start_loc[:-1].long()[sampling] + d.kept[sampling] - 1
        hidden = mtp_hidden[last]
        drafts = [model.compute_logits(hidden).argmax(dim=-1)]
        base = st.num_computed[r].long()  # committed after this step's post-update
        ns = r.shape[0]
        one = torch.arange(ns + 1, dtype=torch.int32, device=r.device)
        for step in range(1, self.k):
            pos = base + step - 1  # MTP row p pairs token p+1 with hidden p
            blocks = st.block_table[r, pos // self.block_size].long()
            attn = AttnMetadata(query_start_loc=one, seq_lens=(pos + 1).to(torch.int32),
                                block_table=st.block_table[r], slot_mapping=blocks * self.block_size
                                + pos % self.block_size)
            hidden = model.mtp(drafts[-1], hidden, pos, attn, self.caches.kv["mtp"])
            drafts.append(model.compute_logits(hidden).argmax(dim=-1))
        table = torch.stack(drafts, dim=1)
        st.draft_tokens[r] = table
        return ids, table[:, :-1]

    def _check(self, ids: torch.Tensor, d: DraftInputs) -> None:
        bad = torch.nonzero((ids < 0) | (ids >= self.vocab_size)).flatten().tolist()
        if bad:
            t = bad[0]
            row = int(torch.searchsorted(d.query_start_loc[1:], torch.tensor(t, device=ids.device), right=True))
            raise DrafterInputError(
                f"drafter input id {int(ids[t])} (outside [0, {self.vocab_size})) for request slot "
                f"{int(d.idx[row])} at position {int(d.positions[t])}; {len(bad)} bad id(s) in this step")

    def _scripted(self, d: DraftInputs, sampling: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        st = self.state
        r = d.idx[sampling]
        m = (st.num_tokens[r] - st.num_prompt[r]).long()  # drafts stand for outputs m, m+1, ...
        cols = m[:, None] + torch.arange(self.k, device=r.device)[None, :]
        truth = st.truth[r[:, None], cols.clamp(max=st.truth.shape[1] - 1)]
        truth = torch.where(cols < st.truth.shape[1], truth, torch.zeros_like(truth))
        c = st.num_correct[r, m.clamp(max=st.num_correct.shape[1] - 1)]
        j = torch.arange(self.k, device=r.device)[None, :]
        st.draft_tokens[r] = torch.where(j < c[:, None].long(), truth, (truth + 1) % self.vocab_size)
        return st.last_sampled[r], d.input_ids.new_zeros(r.shape[0], 0)
