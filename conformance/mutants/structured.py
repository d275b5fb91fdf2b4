"""The structured-outputs record (issue 36), re-created in one async engine instance.

Each patches the instance's grammar slots (``engine.grammars``: admission, release, the step's bitmask)
or its post-step writer, never a module or a class for longer than one call of that instance. The scenarios
that catch them (``structured-*``) need the embedded default model's tokenizer (xgrammar's vocabulary):
the mutants declare ``tokenizer=True``.
"""

from __future__ import annotations

import torch

from conformance.mutants.base import Mutant
from conformance.mutants.params import _writer

SCRIPTED, NGRAM, PREEMPTION = "structured-scripted-k3", "structured-ngram-k3", "structured-preemption-k3"


def _rows_misaligned(engine) -> None:
    """vLLM #49694/#49738: the bitmask is laid out by the drafts each row really verifies, but read by the
    positions the host scheduled: after a row with fewer drafts, every row reads rows of the one before."""
    g = engine.grammars
    bitmask = g.bitmask

    def packed(plan):
        buf = bitmask(plan)
        windows = torch.cat([buf.tensor[i, : 1 + len(g.window_drafts(plan, i))]
                             for i in range(len(plan.rows))])
        buf.tensor.fill_(-1)
        buf.tensor.view(-1, buf.tensor.shape[-1])[: windows.shape[0]] = windows
        return buf

    g.bitmask = packed


def _rejected_drafts_advance(engine) -> None:
    """The matcher is advanced by a window's drafts when its bitmask is built and never rolled back: the
    kept ones are not accepted twice, but the rejected ones stay in the grammar's state."""
    g = engine.grammars
    admit = g.admit

    def admit_advancing(req):
        admit(req)
        state = req.grammar
        if state is None:
            return
        window, accept = state.window_bitmask, state.accept
        ahead: list[int] = []  # drafts the matcher holds that no kept token matched yet

        def window_advancing(drafts):
            out = window(drafts)
            ahead.clear()
            for t in drafts:
                if not accept(t):
                    break
                ahead.append(t)
            return out

        def accept_over_drafts(token):
            if ahead and ahead[0] == token:
                ahead.pop(0)
                return True
            ahead.clear()
            return accept(token)

        state.window_bitmask, state.accept = window_advancing, accept_over_drafts

    g.admit = admit_advancing


def _padded_draft_reaches_matcher(engine) -> None:
    """vLLM #29821/#44006: the grammar is advanced by a row's sampled tokens as the device laid them out,
    -1 past the kept ones, and a refused token is "Failed to advance FSM"."""
    k = engine.config.speculative.num_speculative_tokens

    def mutated(real, core, outcomes, **kw):
        finished, proposals = real(core, outcomes, **kw)
        for o in outcomes:
            req = o.request
            if o.tokens is None or req.grammar is None or req.is_finished or o.num_drafts is None:
                continue
            for t in [-1] * (k + 1 - len(o.tokens)):
                if not req.grammar.accept(t):
                    raise RuntimeError(f"Failed to advance FSM for request {req.request_id} for tokens {t}")
        return finished, proposals

    _writer(engine, mutated)


def _bonus_mask_from_padding(engine) -> None:
    """vLLM #44297: the bonus position (after a row's last draft) takes its mask from a padding slot, which
    allows every id."""
    g = engine.grammars
    bitmask = g.bitmask

    def bonus_unmasked(plan):
        buf = bitmask(plan)
        for i, row in enumerate(plan.rows):
            drafts = g.window_drafts(plan, i)
            if drafts:
                buf.tensor[i, len(drafts)] = torch.full_like(buf.tensor[i, len(drafts)], -1)
        return buf

    g.bitmask = bonus_unmasked


def _kept_on_reused_slot(engine) -> None:
    """vLLM #43894's pattern: release leaves a slot's grammar state in place and admission writes one only
    when the slot has none, so a request on a reused slot runs under its previous owner's grammar."""
    g = engine.grammars
    admit, release = g.admit, g.release
    left: dict[int, object] = {}  # slot -> the state its last owner left

    def release_keeping(req):
        if req.idx >= 0 and req.grammar is not None:
            left[req.idx] = req.grammar
        release(req)

    def admit_reusing(req):
        admit(req)
        state = left.get(req.idx)
        if state is not None:
            g.owner[req.idx], req.grammar = req, state

    g.release, g.admit = release_keeping, admit_reusing


def _resumed_not_rebuilt(engine) -> None:
    """A request resumed after preemption gets a fresh matcher: its committed outputs are not replayed."""
    g = engine.grammars
    admit = g.admit

    def admit_fresh(req):
        admit(req)
        if req.grammar is not None and req.output_token_ids:
            req.grammar = engine.core.grammar_state(req)

    g.admit = admit_fresh


def structured_mutants() -> tuple:
    """The mutants of structured outputs."""
    def m(mid, origin, contract, description, patch, scenarios):
        return Mutant(mid, origin, contract, description, patch, "full_and_piecewise", scenarios,
                      tokenizer=True)

    rows = "issue 36: each verify position's mask is its own row's grammar after the drafts before it"
    kept = "issue 36: only kept tokens advance the grammar"
    slots = "issue 36: a slot's grammar state is its request's"
    return (
        m("grammar-rows-misaligned", "vLLM #49694/#49738", rows,
          "the bitmask is packed by the drafts each row verifies but read by the positions scheduled: rows "
          "after one with fewer drafts read the rows before theirs", _rows_misaligned, (NGRAM,)),
        m("grammar-rejected-drafts-advance", "own", kept,
          "the matcher is advanced by a window's drafts and never rolled back: rejected drafts stay in it",
          _rejected_drafts_advance, (SCRIPTED,)),
        m("grammar-padded-draft", "vLLM #29821/#44006", kept,
          "the grammar is advanced by a row's padded sampled tokens (-1 past the kept ones)",
          _padded_draft_reaches_matcher, (SCRIPTED,)),
        m("grammar-bonus-mask-from-padding", "vLLM #44297", rows,
          "the bonus position after a row's last draft takes a padding slot's mask (every id allowed)",
          _bonus_mask_from_padding, (SCRIPTED,)),
        m("grammar-kept-on-reused-slot", "vLLM #43894", slots,
          "a request admitted onto a reused slot runs under the grammar state its previous owner left",
          _kept_on_reused_slot, (SCRIPTED,)),
        m("grammar-resumed-not-rebuilt", "own", slots,
          "a request resumed after preemption gets a fresh matcher, its committed outputs not replayed",
          _resumed_not_rebuilt, (PREEMPTION,)),
    )
