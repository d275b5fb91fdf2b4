"""Triggers of the structured-outputs scenarios (in conformance.checks.triggers.TRIGGERS), judged on the
reference run: where a grammar meets a verify window, and seats that change hands."""

from __future__ import annotations

from collections.abc import Callable

from conformance.trace import Trace
from conformance.workloads.scenario import Scenario


def _constrained(sc: Scenario) -> set[str]:
    return {r.request_id for r in sc.requests if r.sampling.get("structured_outputs") is not None}


def _draft_rejected(sc: Scenario, t: Trace) -> bool:
    """A constrained request verified a step that rejected one of its drafts."""
    return any(d > a for rid in _constrained(sc) if rid in t.requests for d, a in t.requests[rid].acceptance)


def _window_accepted(sc: Scenario, t: Trace) -> bool:
    """A constrained request accepted every draft of a step of two or more (its bonus token's mask is the
    grammar's after all of them)."""
    return any(d >= 2 and a == d for rid in _constrained(sc) if rid in t.requests
               for d, a in t.requests[rid].acceptance)


def _end_in_window(sc: Scenario, t: Trace) -> bool:
    """A constrained request's grammar completed on a later token of a verify window."""
    for rid in _constrained(sc):
        req = t.requests.get(rid)
        if req is None or req.finish_reason != "stop" or len(req.token_steps) < 2:
            continue
        if req.token_kinds[-1] == "decode" and req.token_steps[-1] == req.token_steps[-2]:
            return True
    return False


def _slot_changes_hands(sc: Scenario, t: Trace) -> bool:
    """A constrained request was admitted right after another constrained request left."""
    cs = _constrained(sc)
    first, last = {}, {}
    for s in t.steps:
        for r in s.rows:
            first.setdefault(r.request_id, s.index)
            last[r.request_id] = s.index
    ended = {last[rid] for rid in cs if rid in last}
    return any(first[rid] - 1 in ended for rid in cs if rid in first)


def _zero_draft_beside_drafts(sc: Scenario, t: Trace) -> bool:
    """A decode row with fewer drafts than another ran ahead of a constrained row with drafts, in one step."""
    cs = _constrained(sc)
    for s in t.steps:
        decode = [r for r in s.rows if r.kind == "decode"]
        fewest = None
        for r in decode:
            n = len(r.draft_token_ids)
            if fewest is not None and r.request_id in cs and n > fewest:
                return True
            fewest = n if fewest is None else min(fewest, n)
    return False


STRUCTURED_TRIGGERS: dict[str, tuple[str, Callable[[Scenario, Trace], bool]]] = {
    "grammar-draft-rejected": ("a request with structured outputs had a draft rejected", _draft_rejected),
    "grammar-window-accepted": (
        "a request with structured outputs accepted every draft of a verify step of two or more",
        _window_accepted),
    "grammar-end-in-window": (
        "a request's grammar completed on a later token of a verify window", _end_in_window),
    "grammar-slot-changes-hands": (
        "a request with structured outputs was admitted right after another one left", _slot_changes_hands),
    "grammar-zero-draft-beside-drafts": (
        "a decode row with fewer drafts ran ahead of a constrained row with more, in one step",
        _zero_draft_beside_drafts),
}
