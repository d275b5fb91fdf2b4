"""Triggers of the scenarios whose requests carry parameters (in conformance.checks.triggers.TRIGGERS).

Each is judged on the reference run (the prefix-cache one on its cached run) and reads the scenario's
request parameters; the stop-string ones count one token per byte of the stop string (the embedded
default model's byte-level tokenizer, where the corpus is tuned).
"""

from __future__ import annotations

from collections.abc import Callable

from conformance.trace import RequestTrace, Trace
from conformance.workloads.scenario import Scenario

PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def _specs(sc: Scenario) -> dict:
    return {r.request_id: r for r in sc.requests}


def _restricted(sc: Scenario) -> set[str]:
    return {r.request_id for r in sc.requests if r.restricted}


def _unrestricted_beside(sc: Scenario, t: Trace) -> bool:
    rs = _restricted(sc)
    return any(any(r.request_id in rs for r in s.rows) and any(r.request_id not in rs for r in s.rows)
               for s in t.steps)


def _rows_reordered(sc: Scenario, t: Trace) -> bool:
    """A restricted request ran at another row of the batch than in the step before, which it ran in too."""
    rs = _restricted(sc)
    for prev, cur in zip(t.steps, t.steps[1:]):
        a = {r.request_id: i for i, r in enumerate(prev.rows)}
        b = {r.request_id: i for i, r in enumerate(cur.rows)}
        if any(rid in rs and rid in a and a[rid] != i for rid, i in b.items()):
            return True
    return False


def _slot_reused_unrestricted(sc: Scenario, t: Trace) -> bool:
    """An unrestricted request was admitted while a restricted request had finished in the step before:
    it takes the seat that request left."""
    rs = _restricted(sc)
    first = {}
    for s in t.steps:
        for r in s.rows:
            first.setdefault(r.request_id, s.index)
    last = {}
    for s in t.steps:
        for r in s.rows:
            last[r.request_id] = s.index
    ended = {last[rid] for rid in rs if rid in last and t.requests.get(rid) is not None}
    return any(rid not in rs and rid in first and first[rid] - 1 in ended for rid in t.requests)


def _window_positions(req: RequestTrace) -> list[bool]:
    """Per output position: whether it was a later token of a verify window (not the window's first)."""
    return [i > 0 and req.token_kinds[i] == "decode" and req.token_steps[i] == req.token_steps[i - 1]
            for i in range(len(req.token_steps))]


def _min_tokens_end_in_window(sc: Scenario, t: Trace) -> bool:
    """A request with min_tokens m stopped on a stop id at its first allowed position m, a later token of
    a verify window."""
    for rid, spec in _specs(sc).items():
        m = spec.sampling.get("min_tokens", 0)
        req = t.requests.get(rid)
        if not m or req is None or req.finish_reason != "stop" or len(req.token_ids) != m + 1:
            continue
        inner = _window_positions(req)
        if m < len(inner) and inner[m]:
            return True
    return False


def _stop_held_in_window(sc: Scenario, t: Trace) -> bool:
    """Under min_tokens, a later position of a verify window had a stop id as its raw argmax (the
    request's logprobs show it): min_tokens held it back inside the window."""
    for rid, spec in _specs(sc).items():
        m, req = spec.sampling.get("min_tokens", 0), t.requests.get(rid)
        if not m or req is None or not req.logprobs or not spec.stop_token_ids:
            continue
        inner = _window_positions(req)
        for pos in range(min(m, len(inner), len(req.logprobs))):
            best = max(req.logprobs[pos], key=lambda e: e[1])[0]
            if inner[pos] and best in spec.stop_token_ids and req.token_ids[pos] != best:
                return True
    return False


def _penalties_over_drafts(sc: Scenario, t: Trace) -> bool:
    """A request under a penalty accepted two drafts or more in one verify step, and repeats a token."""
    for rid, spec in _specs(sc).items():
        req = t.requests.get(rid)
        if req is None or not any(n in spec.sampling for n in PENALTIES):
            continue
        if any(a >= 2 for _, a in req.acceptance) and len(set(req.token_ids)) < len(req.token_ids):
            return True
    return False


def _stop_string(sc: Scenario, t: Trace) -> list[tuple[RequestTrace, str]]:
    return [(req, req.stop_reason) for req in t.requests.values()
            if req.finish_reason == "stop" and isinstance(req.stop_reason, str)]


def _produced(t: Trace, rid: str) -> int:
    return sum(len(r.output_token_ids) for r in t.rows_of(rid) if r.output_token_ids)


def _stop_string_in_window(sc: Scenario, t: Trace) -> bool:
    """A stop string ended a request inside a verify window: tokens the window kept after it were dropped."""
    return any(_produced(t, req.request_id) > len(req.token_ids) and req.token_kinds[-1:] == ["decode"]
               for req, _ in _stop_string(sc, t))


def _stop_string_across_windows(sc: Scenario, t: Trace) -> bool:
    """A stop string's first and last tokens came from two engine steps (one token per byte)."""
    for req, stop in _stop_string(sc, t):
        n = len(stop.encode())
        if 1 < n <= len(req.token_steps) and req.token_steps[-n] != req.token_steps[-1]:
            return True
    return False


def _stop_string_at_length(sc: Scenario, t: Trace) -> bool:
    """A stop string was completed by a request's max_tokens-th token: the stop wins over the length cap."""
    specs = _specs(sc)
    return any(len(req.token_ids) == specs[req.request_id].max_tokens for req, _ in _stop_string(sc, t)
               if req.request_id in specs)


def _logprobs_in_window(sc: Scenario, t: Trace) -> bool:
    """A request asking for logprobs kept two tokens or more of a verify step that rejected a draft."""
    asked = {r.request_id for r in sc.requests if r.sampling.get("logprobs") is not None}
    return any(rid in asked and any(d > a >= 1 for d, a in req.acceptance) for rid, req in t.requests.items())


def _prompt_logprobs_chunked(sc: Scenario, t: Trace) -> bool:
    """A request asking for prompt logprobs had its prompt prefilled in two chunks or more."""
    asked = {r.request_id for r in sc.requests if r.sampling.get("prompt_logprobs") is not None}
    chunks: dict[str, int] = {}
    for s in t.steps:
        for r in s.rows:
            if r.request_id in asked and r.kind == "prefill":
                chunks[r.request_id] = chunks.get(r.request_id, 0) + 1
    return any(n >= 2 for n in chunks.values())


def _zero_draft_beside_drafts(sc: Scenario, t: Trace) -> bool:
    """A decode row that verified no draft ran ahead of a penalised row that verified some, in one step."""
    rs = {r.request_id for r in sc.requests if any(r.sampling.get(p) for p in PENALTIES[:2])
          or r.sampling.get("repetition_penalty", 1.0) != 1.0}
    for s in t.steps:
        seen_zero = False
        for r in s.rows:
            if r.kind != "decode":
                continue
            if not r.draft_token_ids:
                seen_zero = True
            elif seen_zero and r.request_id in rs:
                return True
    return False


def _params_preemption(sc: Scenario, t: Trace) -> bool:
    rs = _restricted(sc)
    return any(rid in rs for s in t.steps for rid in s.preempted)


def _params_prefix_hit(sc: Scenario, t: Trace) -> bool:
    rs = _restricted(sc)
    return any(rid in rs and r.num_cached_tokens for rid, r in t.requests.items())


PARAM_TRIGGERS: dict[str, tuple[str, Callable[[Scenario, Trace], bool]]] = {
    "unrestricted-beside-restricted": (
        "a request without parameters shared a step with one whose parameters change its tokens",
        _unrestricted_beside),
    "params-rows-reordered": (
        "a request with parameters ran at another batch row than in the step before", _rows_reordered),
    "slot-reused-unrestricted": (
        "a request without parameters was admitted right after a request with parameters left",
        _slot_reused_unrestricted),
    "min-tokens-end-in-window": (
        "a request stopped on a stop id at its first position past min_tokens, inside a verify window",
        _min_tokens_end_in_window),
    "stop-held-in-window": (
        "under min_tokens, a stop id was the raw argmax at a later position of a verify window",
        _stop_held_in_window),
    "penalties-over-drafts": (
        "a request under a penalty accepted two drafts or more in one verify step and repeated a token",
        _penalties_over_drafts),
    "stop-string-in-window": (
        "a stop string ended a request inside a verify window (kept tokens after it dropped)",
        _stop_string_in_window),
    "stop-string-across-windows": (
        "a stop string's first and last tokens came from different engine steps",
        _stop_string_across_windows),
    "stop-string-at-length": (
        "a stop string was completed by a request's max_tokens-th token", _stop_string_at_length),
    "logprobs-in-window": (
        "a request asking for logprobs kept two or more tokens of a verify step that rejected a draft",
        _logprobs_in_window),
    "prompt-logprobs-chunked": (
        "a request asking for prompt logprobs had its prompt prefilled in two chunks or more",
        _prompt_logprobs_chunked),
    "zero-draft-beside-drafts": (
        "a decode row without drafts ran ahead of a penalised row with drafts in one step",
        _zero_draft_beside_drafts),
    "params-preemption": ("a request with parameters was preempted", _params_preemption),
    "params-prefix-hit": ("a request with parameters was served tokens from the prefix cache",
                          _params_prefix_hit),
}
PARAM_CACHE_TRIGGERS = frozenset({"params-prefix-hit"})
