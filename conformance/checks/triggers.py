"""Workload power: did the reference run actually exercise what the scenario exists for?

A scenario names triggers (a preemption happened, chunk tails of every size ran, ...). If a change
to the scheduler or the model makes a workload stop hitting its trigger, this check says so,
instead of the suite silently losing the power to catch the bug the scenario targets.

The prefix-caching triggers (``CACHE_TRIGGERS``) are judged on the reference engine's run *with* the
scenario's caching (the "cached" trace); the others on the oracle's run without it.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from types import MappingProxyType

from conformance.checks.cache_floor import floor
from conformance.checks.param_triggers import PARAM_CACHE_TRIGGERS, PARAM_TRIGGERS
from conformance.checks.prefix_cache import Timeline, bounds, no_eviction_before, tokens_of
from conformance.checks.registry import CheckInputs, check
from conformance.checks.sampling_triggers import SAMPLING_TRIGGERS
from conformance.checks.structured_triggers import STRUCTURED_TRIGGERS
from conformance.results import CheckResult, failed, not_applicable, passed
from conformance.trace import Trace
from conformance.workloads.scenario import Scenario


def _new_short_prompt(sc: Scenario, t: Trace) -> bool:
    return any(r.num_computed_tokens == 0 and r.query_len <= sc.k + 2 for s in t.steps for r in s.rows)


def _mixed_batch(sc: Scenario, t: Trace) -> bool:
    return any(any(r.num_computed_tokens == 0 for r in s.rows) and any(r.kind == "decode" for r in s.rows)
               for s in t.steps)


def _chunk_tails(sc: Scenario, t: Trace) -> bool:
    tails = {r.query_len for s in t.steps for r in s.rows
             if r.kind == "prefill" and r.has_initial_state and r.output_token_ids is not None}
    return set(range(1, sc.k + 2)) <= tails


def _batch_churn(sc: Scenario, t: Trace) -> bool:
    moves = 0
    for prev, cur in zip(t.steps, t.steps[1:]):
        a, b = {r.request_id for r in prev.rows}, {r.request_id for r in cur.rows}
        moves += bool(a - b) and bool(b - a) and bool(a & b)
    return moves >= 2


def _preemption(sc: Scenario, t: Trace) -> bool:
    return any(s.preempted for s in t.steps)


def _recycled_slot(sc: Scenario, t: Trace) -> bool:
    readers: dict[int, set[str]] = {}
    for s in t.steps:
        for r in s.rows:
            if r.state_slot_read is not None:
                readers.setdefault(r.state_slot_read, set()).add(r.request_id)
    return any(len(v) > 1 for v in readers.values())


def _decode_batches(sc: Scenario, t: Trace) -> bool:
    sizes = {len(s.rows) for s in t.steps if s.rows and all(r.kind == "decode" for r in s.rows)}
    return {3, 5, 7} <= sizes


def _accepted(t: Trace) -> set[int]:
    return {a for req in t.requests.values() for _, a in req.acceptance}


def _zero_draft_after_accept(sc: Scenario, t: Trace) -> bool:
    """A request's verify step accepted drafts and its next verify step (no re-prefill between) had none:
    the step that must read the state of the last accepted token, not the first slot (vLLM #52942)."""
    after = _after_accept(t)
    return any(after[(r.step, r.request_id)] and not r.draft_token_ids
               for rid in t.requests for r in t.rows_of(rid) if (r.step, rid) in after)


def _after_accept(t: Trace) -> dict[tuple[int, str], bool]:
    """(step, request) of every verify row -> whether the request's verify row before it (no re-prefill
    between) accepted drafts: a row whose recurrent state is then not at the first slot."""
    after: dict[tuple[int, str], bool] = {}
    for rid in t.requests:
        previous = None
        for r in t.rows_of(rid):
            if r.kind != "decode" or r.num_accepted is None:
                previous = None
                continue
            after[(r.step, rid)] = previous is not None and previous.num_accepted >= 1
            previous = r
    return after


def _decode_steps(t: Trace):
    """(step, its verify rows) of every step that verified a row."""
    for s in t.steps:
        rows = [r for r in s.rows if r.kind == "decode" and r.num_accepted is not None]
        if rows:
            yield s, rows


def _zero_draft_step(sc: Scenario, t: Trace) -> bool:
    """A step in which no verify row had drafts, one of them right after a step that accepted some: no
    accepted counts need pass for the step, yet its rows must read the state of their last kept token
    (vLLM #39273)."""
    after = _after_accept(t)
    return any(not any(r.draft_token_ids for r in rows)
               and any(after.get((s.index, r.request_id)) for r in rows) for s, rows in _decode_steps(t))


def _spec_and_nonspec_rows(sc: Scenario, t: Trace) -> bool:
    """A step whose verify rows with drafts ran next to rows with none, one of them right after a step that
    accepted drafts: spec and non-spec decodes must be split (vLLM #35447)."""
    after = _after_accept(t)
    return any(any(r.draft_token_ids for r in rows) and any(not r.draft_token_ids for r in rows)
               and any(after.get((s.index, r.request_id)) for r in rows) for s, rows in _decode_steps(t))


def _partial_drafts(sc: Scenario, t: Trace) -> bool:
    return any(0 < d < sc.k for req in t.requests.values() for d, _ in req.acceptance)


def _stop_mid_window(sc: Scenario, t: Trace) -> bool:
    for req in t.requests.values():
        produced = sum(len(r.output_token_ids) for r in t.rows_of(req.request_id) if r.output_token_ids)
        if req.finish_reason == "stop" and produced > len(req.token_ids):
            return True
    return False


def _hits(t: Trace) -> dict[str, int]:
    return {rid: r.num_cached_tokens for rid, r in t.requests.items() if r.num_cached_tokens}


def _hit_on_output(sc: Scenario, t: Trace) -> bool:
    """A hit reached into tokens another request generated (a multi-turn chat's earlier reply)."""
    for rid, h in _hits(t).items():
        prompt = tuple(t.requests[rid].prompt_token_ids[:h])
        if any(oid != rid and len(o.prompt_token_ids) < h and tokens_of(o)[:h] == prompt
               for oid, o in t.requests.items()):
            return True
    return False


def _hit_short_tail(sc: Scenario, t: Trace) -> bool:
    return any(len(t.requests[rid].prompt_token_ids) - h < 1 + sc.k for rid, h in _hits(t).items())


def _hit_block_edges(sc: Scenario, t: Trace) -> bool:
    bs = sc.settings.block_size
    return {bs - 1, 0, 1} <= {len(t.requests[rid].prompt_token_ids) % bs for rid in _hits(t)}


def _concurrent_hits(sc: Scenario, t: Trace) -> bool:
    hits = _hits(t)
    return any(sum(r.request_id in hits for r in s.rows) >= 2 for s in t.steps)


def _eviction(sc: Scenario, t: Trace) -> bool:
    """A request got fewer cached tokens than a cache that evicted nothing would have given it."""
    timeline = Timeline(t)
    return any((r.num_cached_tokens or 0) < bounds(rid, sc, t, timeline, assume_no_eviction=True).lower
               for rid, r in t.requests.items())


def _floor_under_pressure(sc: Scenario, t: Trace) -> bool:
    """A request the pool may have evicted blocks for still had a floor above 0 ("cache-floor"): the
    scenario holds a cache under pressure to what it must have kept."""
    if not sc.caching or sc.settings.num_kv_blocks is None:
        return False
    timeline = Timeline(t)
    for rid in t.requests:
        if rid in sc.aborted or timeline.first_step(rid) is None:
            continue
        if not no_eviction_before(rid, sc, t, timeline) and floor(rid, sc, t, timeline).lower > 0:
            return True
    return False


def _kept_span(row) -> tuple[int, int] | None:
    """A verify row's committed tokens (start, end]: the positions it kept, None for other rows."""
    if row.kind != "decode" or not row.output_token_ids:
        return None
    return row.num_computed_tokens, row.num_computed_tokens + len(row.output_token_ids)


def _boundaries_in_one_step(sc: Scenario, t: Trace) -> bool:
    """A verify step's kept tokens passed two block boundaries or more (block size <= K)."""
    bs = sc.settings.block_size
    for s in t.steps:
        for r in s.rows:
            span = _kept_span(r)
            if span is not None and span[1] // bs - span[0] // bs >= 2:
                return True
    return False


def _checkpoint_inside_step(sc: Scenario, t: Trace) -> bool:
    """A hit ended at a block boundary that a verify step of another request passed inside its kept tokens
    (not at its last kept token): the checkpoint came from a column inside the step."""
    bs, hits = sc.settings.block_size, _hits(t)
    inside: dict[str, set[int]] = {}
    for s in t.steps:
        for r in s.rows:
            span = _kept_span(r)
            if span is not None:
                inside.setdefault(r.request_id, set()).update(
                    b for b in range((span[0] // bs + 1) * bs, span[1], bs))
    for rid, h in hits.items():
        prompt = tuple(t.requests[rid].prompt_token_ids[:h])
        if any(oid != rid and h in marks and tokens_of(t.requests[oid])[:h] == prompt
               for oid, marks in inside.items() if oid in t.requests):
            return True
    return False


def _blocks_at_offsets(sc: Scenario, t: Trace) -> bool:
    """Two prompts hold the same token block at different block offsets."""
    bs = sc.settings.block_size
    where: dict[tuple[int, ...], set[int]] = {}
    for req in t.requests.values():
        p = req.prompt_token_ids
        for i in range(len(p) // bs):
            where.setdefault(tuple(p[i * bs: (i + 1) * bs]), set()).add(i)
    return any(len(offsets) > 1 for offsets in where.values())


def _off_grid_chunk_before_hit(sc: Scenario, t: Trace) -> bool:
    """A prompt chunk started off the block grid, and a later request hit blocks of that prompt past it."""
    bs, hits = sc.settings.block_size, _hits(t)
    for s in t.steps:
        for r in s.rows:
            start = r.num_computed_tokens
            if r.kind != "prefill" or start % bs == 0 or r.request_id not in t.requests:
                continue
            source = tokens_of(t.requests[r.request_id])
            if any(oid != r.request_id and h > start
                   and tuple(t.requests[oid].prompt_token_ids[:h]) == source[:h]
                   and min(o.step for o in t.rows_of(oid)) > s.index for oid, h in hits.items()):
                return True
    return False


def _at_max_len(sc: Scenario, t: Trace) -> list[str]:
    mml = sc.settings.max_model_len
    if mml is None:
        return []
    return [rid for rid, r in t.requests.items()
            if r.finish_reason == "length" and len(r.prompt_token_ids) + len(r.token_ids) == mml]


def _length_stop_at_max_len(sc: Scenario, t: Trace) -> bool:
    """Under speculation a request ran into max_model_len after verify steps (its length stop came from the
    model's limit, not from max_tokens)."""
    return bool(sc.k) and any(t.requests[rid].acceptance for rid in _at_max_len(sc, t))


def _ngram_max_model_len(sc: Scenario, t: Trace) -> bool:
    return sc.settings.drafter == "ngram" and _length_stop_at_max_len(sc, t)


def _chunk_ahead_of_sampling(sc: Scenario, t: Trace) -> bool:
    """With MTP and K >= 2, a prompt chunk that does not sample ran in one step with a row of
    a new prompt that samples: a batch laid out by row category (decodes,
    extends, first chunks; the async engine's) puts the chunk ahead of that prompt, and the drafter's
    chained passes must skip it. The reference engine orders its rows otherwise, so the trigger asks for
    the company the chunk keeps, not for its place."""
    if sc.k < 2 or sc.settings.drafter != "mtp":
        return False
    for s in t.steps:
        chunks = [r for r in s.rows if r.kind == "prefill" and r.output_token_ids is None]
        sampling = [r for r in s.rows if r.output_token_ids is not None]
        if chunks and any(r.kind == "prefill" and r.num_computed_tokens == 0 for r in sampling):
            return True
    return False


def _shared_preemption(sc: Scenario, t: Trace) -> bool:
    """A request was preempted while another live request shared its first cached block."""
    hits, n = _hits(t), sc.settings.block_size + 1
    live = {rid: (rows[0].step, rows[-1].step) for rid, rows in Timeline(t).rows.items()}
    for step in t.steps:
        for victim in step.preempted:
            head = t.requests[victim].prompt_token_ids[:n] if victim in t.requests else None
            if head is None or len(head) < n:
                continue
            if any(
                oid != victim
                and (victim in hits or oid in hits)
                and o.prompt_token_ids[:n] == head
                and oid in live
                and live[oid][0] < step.index <= live[oid][1]
                for oid, o in t.requests.items()
            ):
                return True
    return False


TRIGGERS: Mapping[str, tuple[str, Callable[[Scenario, Trace], bool]]] = MappingProxyType(
    {
        "new-short-prompt": ("a new prompt of at most K+2 tokens was scheduled", _new_short_prompt),
        "mixed-batch": ("a new prompt shared a step with running decodes", _mixed_batch),
        "chunk-tails": ("prompt chunks ended in tails of every length 1..K+1", _chunk_tails),
        "batch-churn": ("requests left and joined the batch between consecutive steps", _batch_churn),
        "preemption": ("the KV pool ran out and a request was preempted", _preemption),
        "recycled-slot": ("a state slot was read by two different requests over the run", _recycled_slot),
        "decode-batches-3-5-7": ("decode-only steps with 3, 5 and 7 rows ran", _decode_batches),
        "accept-all": ("a verify step accepted all K drafts", lambda sc, t: sc.k in _accepted(t)),
        "reject-all": ("a verify step rejected every draft", lambda sc, t: 0 in _accepted(t)),
        "every-accept-count": (
            "every accepted count 0..K occurred",
            lambda sc, t: set(range(sc.k + 1)) <= _accepted(t),
        ),
        "spec-verify": ("speculative verify steps ran", lambda sc, t: bool(_accepted(t))),
        "stop-mid-window": ("a stop token ended a request inside a verified window", _stop_mid_window),
        "zero-draft-after-accept": (
            "a request verified no drafts right after a step that accepted some",
            _zero_draft_after_accept,
        ),
        "partial-drafts": ("a verify step had drafts, but fewer than K", _partial_drafts),
        "zero-draft-step": (
            "a step in which no row verified drafts, one right after a step that accepted some",
            _zero_draft_step,
        ),
        "spec-and-nonspec-rows": (
            ("rows verifying drafts ran next to rows verifying none, one right after a step that accepted "
             "some"),
            _spec_and_nonspec_rows,
        ),
        "prefix-hit": ("a request was served tokens from the prefix cache", lambda sc, t: bool(_hits(t))),
        "hit-on-output": ("a prefix hit covered tokens an earlier request generated", _hit_on_output),
        "hit-short-tail": ("a prefix hit left fewer than 1+K prompt tokens to compute", _hit_short_tail),
        "hit-block-edges": (
            "prompts of block-size multiples -1, 0 and +1 tokens were served from the cache",
            _hit_block_edges,
        ),
        "concurrent-hits": ("two requests served from the cache ran in the same step", _concurrent_hits),
        "eviction": (
            "a request got fewer cached tokens than a cache that evicted nothing would give",
            _eviction,
        ),
        "shared-preemption": (
            "a request was preempted while another request shared its cached prefix",
            _shared_preemption,
        ),
        "boundaries-in-one-step": (
            "a verify step's kept tokens passed two block boundaries or more", _boundaries_in_one_step),
        "checkpoint-inside-step": (
            "a hit ended at a boundary another request's verify step passed inside its kept tokens",
            _checkpoint_inside_step,
        ),
        "blocks-at-offsets": (
            "two prompts held the same token block at different offsets", _blocks_at_offsets),
        "off-grid-chunk-before-hit": (
            "a prompt chunk started off the block grid, and a later request hit that prompt's blocks past it",
            _off_grid_chunk_before_hit,
        ),
        "length-stop-at-max-len": (
            "a request that verified drafts ran into max_model_len", _length_stop_at_max_len),
        "ngram-max-model-len": (
            "an n-gram request that verified drafts ran into max_model_len", _ngram_max_model_len),
        "chunk-ahead-of-sampling": (
            "MTP, K >= 2: a prompt chunk that does not sample shared a step with a new prompt that samples",
            _chunk_ahead_of_sampling,
        ),
        "floor-under-pressure": (
            "a request admitted after the pool may have evicted blocks still had a cache floor above 0",
            _floor_under_pressure,
        ),
        **PARAM_TRIGGERS,  # the request-parameter scenarios' (conformance/checks/param_triggers.py)
        **SAMPLING_TRIGGERS,  # the sampled scenarios' (conformance/checks/sampling_triggers.py)
        **STRUCTURED_TRIGGERS,  # the structured-outputs scenarios' (checks/structured_triggers.py)
    }
)
# Judged on the reference engine's run with the scenario's prefix caching.
CACHE_TRIGGERS = frozenset(
    {
        "prefix-hit",
        "hit-on-output",
        "hit-short-tail",
        "hit-block-edges",
        "concurrent-hits",
        "eviction",
        "shared-preemption",
        "floor-under-pressure",
        "boundaries-in-one-step",
        "checkpoint-inside-step",
        "blocks-at-offsets",
        "off-grid-chunk-before-hit",
        *PARAM_CACHE_TRIGGERS,
    }
)


def unknown_trigger(names) -> str | None:
    """The first of ``names`` that is no trigger, as one line with the nearest known name, or None. A
    scenario file's triggers are checked with it where the run is put together (``select_scenarios``):
    the workloads do not import the checks."""
    unknown = [t for t in names if t not in TRIGGERS]
    if not unknown:
        return None
    near = difflib.get_close_matches(str(unknown[0]), list(TRIGGERS), n=1)
    return f"unknown trigger {unknown[0]!r}" + (f" (did you mean {near[0]!r}?)" if near else "")


# Why a forced trigger was missed without failing: the run let a miss warn.
UNFORCED = ("forced only with the scenario's own drafter and settings; this run lets a miss warn "
            "(--allow-unexercised or --drafter)")


def check_triggers(scenario: Scenario, reference: Trace, strict: bool = True, cached: Trace | None = None,
                   require_exercised: bool = False) -> CheckResult:
    """Did the reference run hit the scenario's triggers? This judges the workload, not the engine.
    ``cached``: the reference engine's run with prefix caching, where ``CACHE_TRIGGERS`` are judged (a
    scenario without one misses them).

    A trigger is forced on any checkpoint (scripted drafts, constructed prompts, allowed ids) unless the
    scenario's ``model_decides`` names it with the reason a checkpoint may miss it. ``strict`` (the
    default): a forced trigger missed fails, since the workload no longer tests what it exists for on any
    model. A trigger the model decides, missed, is "not exercised": not applicable, with a warning naming
    the scenario, the trigger and the reason (``details["warning"]``, ``details["not_exercised"]``), never a
    pass; ``require_exercised`` (``--require-exercised``: a gate that asks for every trigger, e.g. on the
    model the corpus is tuned to) makes every miss fail, whatever ``strict`` says. Not strict
    (``--allow-unexercised``, or another drafter than the scenario's): every miss is "not exercised". Each
    miss not failed is a named gap (``details["gaps"]``: what was not exercised, and why) for the reports.
    """
    name = "workload-triggers"
    if not scenario.triggers:
        return not_applicable(name, "the scenario names no triggers")
    unknown = unknown_trigger(scenario.triggers)
    if unknown:
        return failed(name, unknown)
    missed = [t for t in scenario.triggers if not _hit(t, scenario, reference, cached)]
    why = dict(scenario.model_decides)
    failing = [t for t in missed if require_exercised or (strict and t not in why)]
    if failing:
        what = "; ".join(f"{t}: expected that {TRIGGERS[t][0]}" for t in failing)
        return failed(
            name,
            f"the reference run never hit {', '.join(failing)}",
            f"scenario {scenario.id} exists to exercise {', '.join(scenario.triggers)}, but in the "
            f"reference run {what} - it did not happen, so this workload no longer tests what it is for"
            + "".join(f"\n  {t} is " + (f"the model's to reach ({why[t]})" if t in why else
                                         "forced on the scenario's own drafter and checkpoint")
                      + ", and the run asks for every trigger (--require-exercised)"
                      for t in failing if require_exercised),
            missed=missed,
        )
    if missed:
        what = "; ".join(f"{t} ({TRIGGERS[t][0]}" + (f"; {why[t]}" if t in why else "") + ")" for t in missed)
        result = not_applicable(name, f"not exercised on this model: {', '.join(missed)}")
        warning = (f"scenario {scenario.id}: trigger(s) not exercised on this model: {what}; the scenario "
                   "still ran and its other checks hold, but it did not test what it exists for")
        result.details.update(not_exercised=missed, reasons={t: why[t] for t in missed if t in why},
                              warning=warning, gaps=[{"what": f"trigger {t}", "why": why.get(t, UNFORCED)}
                                                     for t in missed])
        return result
    return passed(name, "reference run hit " + ", ".join(scenario.triggers))


@check(
    "workload-triggers",
    reads=("ref", "cached"),
    replay=False,
    passes_when=(
        "the reference run actually hit what the scenario exists for (preemption, chunk tails, a zero-draft "
        "step after accepted drafts, ...: the table below; the prefix-caching triggers, such as a hit at "
        "all, on the reference engine's cached run); a trigger forced on any checkpoint fails when missed, "
        "unless `--allow-unexercised` makes it *not exercised* (n/a plus a warning naming the scenario); one "
        "the scenario says the model decides (its reason in the warning) is *not exercised* when missed, "
        "and fails only where the run asks for every trigger (`--require-exercised`, which fails any miss)"
    ),
)
def _workload_triggers(c: CheckInputs) -> CheckResult:
    return check_triggers(c.scenario, c.ref, strict=c.strict_triggers, cached=c.cached,
                          require_exercised=c.require_exercised)


def _hit(trigger: str, scenario: Scenario, reference: Trace, cached: Trace | None) -> bool:
    trace = cached if trigger in CACHE_TRIGGERS else reference
    return trace is not None and trace.error is None and TRIGGERS[trigger][1](scenario, trace)
