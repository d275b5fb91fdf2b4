"""Structured outputs in the async engine: the host's grammar state per request slot, and each step's bitmask.

A request with structured outputs holds its slot's ``GrammarState`` while it is seated: admission (new, or
resumed after preemption) builds it fresh from the compiled grammar and the request's committed outputs,
so nothing of a reused slot's previous owner survives and a resumed request's matcher is where its output
is; release (finish, abort, preemption) frees the slot and leaves the matcher with the request. The
post-step writer advances it with kept tokens only.

The drafts a step verifies live on the device. The host mirrors, per slot, the drafts the device holds
(``note_drafts``: a step's proposals, copied back with its kept tokens, written where the device wrote
them: rows that sampled, while the slot still has the same owner; admission clears them as the device's
admission does). Once the step before is processed, ``bitmask`` gives the step in flight its grammar
bitmask [Np, K+1, W]: padded row i, position j is the row's grammar after its first j drafts (as many as
the device verifies: its proposal count, at most the positions the host scheduled); every other entry
(rows without a grammar, finished requests, padding, positions past a window) allows every id.
"""

from __future__ import annotations

import torch

from refengine.async_engine.stream import HostBuffer, Stream


class GrammarSlots:
    def __init__(self, core, num_slots: int, num_speculative_tokens: int, vocab_size: int, stream: Stream):
        self.core = core
        self.k = num_speculative_tokens
        self.width = (vocab_size + 31) // 32  # int32 words of a bitmask row
        self.stream = stream
        self.owner: list = [None] * num_slots  # the request seated at each slot that has structured outputs
        self.drafts: list[list[int]] = [[] for _ in range(num_slots)]  # the device's drafts of each slot
        # padded rows -> the host buffer of a step's bitmask [Np, K+1, W] int32: one each suffices, since a
        # step's bitmask is built after the host waited on the step before (whose copy came before it)
        self._buffers: dict[int, HostBuffer] = {}

    def admit(self, req) -> None:
        """``req`` was just seated at ``req.idx`` (new or resumed): its matcher, rebuilt from its outputs."""
        seated = req.compiled_grammar is not None
        self.owner[req.idx] = req if seated else None
        self.drafts[req.idx] = []
        req.grammar = self.core.grammar_state(req, req.output_token_ids) if seated else None

    def release(self, req) -> None:
        """``req`` leaves its slot (finish, abort, preemption). Its matcher stays with the request: a step
        holding its row may still be in flight, and its kept tokens, committed after a preemption, must
        advance the matcher (a completed grammar finishes the request there, as in the reference engine);
        admission rebuilds it from the committed outputs anyway."""
        if req.idx >= 0 and self.owner[req.idx] is req:
            self.owner[req.idx] = None
            self.drafts[req.idx] = []

    def note_drafts(self, plan, fut) -> None:
        """After step ``plan`` is done: the drafts its sampling rows proposed (``fut``'s host copies)."""
        if fut.next_drafts is None:
            return
        drafts, counts = fut.next_drafts.tolist(), fut.next_num_drafts.tolist()
        for i, row in enumerate(plan.rows):
            slot = plan.slots_idx[i]
            if row.samples and self.owner[slot] is row.request:
                self.drafts[slot] = drafts[i][: counts[i]]

    def window_drafts(self, plan, i: int) -> list[int]:
        """The drafts padded row ``i`` of ``plan`` verifies (a decode row; none for a prompt chunk)."""
        if i >= plan.num_decode:
            return []
        return self.drafts[plan.slots_idx[i]][: len(plan.rows[i].draft_token_ids)]

    def bitmask(self, plan) -> HostBuffer:
        """The grammar bitmask of step ``plan`` [Np, K+1, W] int32, in the host buffer of its padded size."""
        n_pad = plan.shape.num_reqs_padded
        buf = self._buffers.get(n_pad)
        if buf is None:
            shape = (n_pad, self.k + 1, self.width)
            buf = HostBuffer(f"grammar-bitmask-{n_pad}", self.stream, shape, torch.int32)
            self._buffers[n_pad] = buf
        out = torch.full((n_pad, self.k + 1, self.width), -1, dtype=torch.int32)
        for i, row in enumerate(plan.rows):
            req = row.request
            if not row.samples or self.owner[plan.slots_idx[i]] is not req or req.grammar is None:
                continue
            window = req.grammar.window_bitmask(self.window_drafts(plan, i))
            out[i, : window.shape[0]] = window
        buf.write(out)  # refused (hazard checking) while an earlier copy from it is pending
        return buf
