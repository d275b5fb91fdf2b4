"""Checks over one trace: metadata shapes, prefill classification, id ranges, slots and pools."""

from __future__ import annotations

from conformance.checks.registry import CheckInputs, check
from conformance.results import CheckResult, failed, not_applicable, passed
from conformance.trace import RowTrace, StepTrace, Trace

# Metadata fields with one entry per request (under refengine's names, and "num_accepted_tokens", the
# upstream name of the kept count an external engine may report), and the one with an entry per request
# plus one.
PER_REQUEST_FIELDS = ("state_indices", "num_valid", "num_accepted_tokens", "has_initial_state", "seq_lens",
                      "context_lens", "block_table")
OFFSETS_FIELD = "query_start_loc"
TRACEBACK_LINES = 30  # last lines of an engine traceback shown in the report (details keep all of it)


def check_runs(test: Trace, expected_requests: list[str]) -> CheckResult:
    """The engine finished every request without raising."""
    if test.duplicate_outputs:
        rid = test.duplicate_outputs[0]
        return failed(
            "runs",
            f"request {rid} was handed back twice",
            f"{test.engine} returned an output for "
            f"request(s) {', '.join(sorted(set(test.duplicate_outputs)))} more than once (an aborted "
            "request must not come back from a later step)",
            rid,
        )
    if test.error is not None:
        last = test.error.strip().splitlines()[-1] if test.error.strip() else "error"
        lines = test.error.rstrip().splitlines()
        if len(lines) > TRACEBACK_LINES:
            lines = [f"... ({len(lines) - TRACEBACK_LINES} traceback lines left out)"] + lines[
                -TRACEBACK_LINES:
            ]
        return failed("runs", f"{test.engine} raised: {last}", f"{test.engine} did not finish the workload:\n"
                      + _indent("\n".join(lines)), traceback=test.error)
    lost = sorted(set(expected_requests) - set(test.requests))
    if lost:
        return failed(
            "runs", f"{len(lost)} request(s) never finished: {', '.join(lost[:8])}", request_id=lost[0]
        )
    return passed("runs", f"{len(expected_requests)} requests finished in {test.num_engine_steps} steps")


@check(
    "runs",
    reads=("test",),
    judges_broken_runs=True,
    passes_when="the engine finished every request without raising",
)
def _runs(c: CheckInputs) -> CheckResult:
    return check_runs(c.test, [r.request_id for r in c.scenario.requests])


def check_full_graph_metadata(test: Trace) -> CheckResult:
    """In FULL-graph steps every per-request metadata tensor is sized by the padded request count."""
    name = "full-graph-metadata"
    full = [s for s in test.steps if s.graph_mode == "full"]
    if not full:
        return not_applicable(name, "no FULL-graph steps ran")
    for step in full:
        problem = _full_step_problem(step)
        if problem:
            rows = len(step.rows)
            return failed(name, f"engine step {step.index}: {problem}",
                          f"engine step {step.index} replayed a FULL graph for {rows} request(s) padded to "
                          f"{step.num_reqs_padded}, but {problem}\n  metadata shapes: "
                          + ", ".join(f"{k}={tuple(v)}" for k, v in step.metadata_shapes.items())
                          + f"\n  query lengths: {[r.query_len for r in step.rows]}",
                          step.rows[0].request_id if step.rows else None, step=step.index,
                          num_reqs_padded=step.num_reqs_padded, shapes=step.metadata_shapes)
    return passed(name, f"{len(full)} FULL-graph steps sized by their padded request count")


@check(
    "full-graph-metadata",
    reads=("test",),
    needs=("rows", "graph_mode", "num_reqs_padded", "metadata_shapes"),
    passes_when=(
        "in FULL-graph steps every per-request metadata tensor has `num_reqs_padded` rows, "
        "`query_start_loc` has `num_reqs_padded + 1`"
    ),
)
def _full_graph_metadata(c: CheckInputs) -> CheckResult:
    return check_full_graph_metadata(c.test)


def _full_step_problem(step: StepTrace) -> str | None:
    padded = step.num_reqs_padded
    if padded is None:
        return "the step did not report its padded request count"
    if padded < len(step.rows):
        return f"the padded request count {padded} is below the {len(step.rows)} scheduled rows"
    for key, shape in step.metadata_shapes.items():
        field = key.partition(".")[2]
        want = padded + 1 if field == OFFSETS_FIELD else padded if field in PER_REQUEST_FIELDS else None
        if want is not None and (not shape or shape[0] != want):
            lead = shape[0] if shape else "none"
            return (
                f"{key} has leading dimension {lead}, expected {want} "
                f"(padded requests{' + 1' if want > padded else ''})"
            )
    return None


def check_new_prompt_prefill(test: Trace) -> CheckResult:
    """Rows of requests with no computed tokens are prefills from zero state, whatever their length."""
    name = "new-prompt-prefill"
    new_rows = [(s, r) for s in test.steps for r in s.rows if r.num_computed_tokens == 0]
    if not new_rows:
        return not_applicable(name, "no step records with new prompts")
    for step, row in new_rows:
        wrong = _classification_problem(row)
        if wrong:
            others = [r for r in step.rows if r is not row]
            company = (
                f"alongside {sum(r.kind == 'decode' for r in others)} decode row(s)" if others else "alone"
            )
            return failed(
                name,
                f"request {row.request_id} (new, {row.query_len}-token query) {wrong} in engine "
                f"step {step.index}",
                f"request {row.request_id} had no computed tokens, so its first row must be a prefill "
                f"that starts from zero state\n  engine step {step.index}, {company}: query of "
                f"{row.query_len} tokens {row.input_ids[:12]}, kind={row.kind!r}, "
                f"has_initial_state={row.has_initial_state}, state slot read={row.state_slot_read}",
                row.request_id,
                step=step.index,
                kind=row.kind,
                query_len=row.query_len,
            )
    short = sum(1 for _, r in new_rows if r.query_len <= 8)
    return passed(
        name, f"{len(new_rows)} new prompts ({short} of at most 8 tokens) started as zero-state prefills"
    )


@check(
    "new-prompt-prefill",
    reads=("test",),
    needs=("rows", "kind", "num_computed_tokens", "query_len", "has_initial_state", "state_slot_read",
           "input_ids"),
    passes_when="rows with no computed tokens are prefills, without initial state, reading no state slot",
)
def _new_prompt_prefill(c: CheckInputs) -> CheckResult:
    return check_new_prompt_prefill(c.test)


def _classification_problem(row: RowTrace) -> str | None:
    if row.kind != "prefill":
        return f"was classified {row.kind!r}"
    if row.has_initial_state:
        return "was given an initial state"
    if row.state_slot_read is not None:
        return f"read state slot {row.state_slot_read}"
    return None


ID_FIELDS = ("input_ids", "drafter_input_ids", "draft_token_ids", "next_draft_token_ids")


def check_id_range(test: Trace, vocab_size: int) -> CheckResult:
    """No id < 0 or >= vocab reaches the model or the drafter, or comes out of the engine."""
    name = "id-range"
    seen = 0
    for step in test.steps:
        for row in step.rows:
            for field in ID_FIELDS:
                ids = getattr(row, field)
                seen += len(ids)
                bad = [t for t in ids if not 0 <= t < vocab_size]
                if bad:
                    return failed(
                        name,
                        f"request {row.request_id}: {field} holds {bad[0]} in engine step {step.index}",
                        f"request {row.request_id}, engine step {step.index}: {field} = "
                        f"{ids} holds {bad[0]}, outside the vocabulary [0, {vocab_size})",
                        row.request_id,
                        step=step.index,
                        field=field,
                        value=bad[0],
                    )
    for rid, req in sorted(test.requests.items()):
        bad = [t for t in req.token_ids if not 0 <= t < vocab_size]
        if bad:
            return failed(
                name,
                f"request {rid}: output token {bad[0]} is outside [0, {vocab_size})",
                request_id=rid,
                field="token_ids",
                value=bad[0],
            )
    if seen == 0:
        return not_applicable(name, "no step records to inspect")
    return passed(name, f"{seen} ids fed to the model and drafter, all in [0, {vocab_size})")


@check(
    "id-range",
    reads=("test",),
    needs=("rows", "input_ids", "drafter_input_ids", "draft_token_ids", "next_draft_token_ids"),
    passes_when=(
        "no id < 0 or >= vocab in `input_ids`, `drafter_input_ids`, `draft_token_ids`, "
        "`next_draft_token_ids`, outputs"
    ),
)
def _id_range(c: CheckInputs) -> CheckResult:
    return check_id_range(c.test, c.vocab_size)


def check_state_slots(test: Trace) -> CheckResult:
    """No two requests in one step read the same recurrent state slot."""
    name = "state-slots"
    if not test.steps:
        return not_applicable(name, "no step records to inspect")
    for step in test.steps:
        owner: dict[int, str] = {}
        for row in step.rows:
            slot = row.state_slot_read
            if slot is None:
                continue
            if slot in owner and owner[slot] != row.request_id:
                return failed(
                    name,
                    f"engine step {step.index}: requests {owner[slot]} and {row.request_id} both "
                    f"read state slot {slot}",
                    request_id=row.request_id,
                    step=step.index,
                    slot=slot,
                )
            owner[slot] = row.request_id
    return passed(name, f"{len(test.steps)} steps, no state slot read by two requests")


@check(
    "state-slots",
    reads=("test",),
    needs=("rows", "state_slot_read"),
    passes_when="no two requests read the same recurrent state slot in one step",
)
def _state_slots(c: CheckInputs) -> CheckResult:
    return check_state_slots(c.test)


# What an instance's occupancy() reports: a pool's used / free counts, and its request queues.
OCCUPANCY_POOLS = (
    ("kv_blocks", "KV blocks"),
    ("state_slots", "state slots"),
    ("request_slots", "request slots"),
)
OCCUPANCY_QUEUES = (("waiting", "waiting requests"), ("running", "running requests"))


def check_pools_empty(test: Trace) -> CheckResult:
    """Once every request finished, no KV block, state slot or request slot is still allocated.

    From the instance's ``occupancy()`` when it has one (each pool named with its used / free
    counts), else from ``pools_empty()`` and the optional ``request_slots_in_use()`` (the harness
    records them as ``trace.occupancy``, ``trace.pools_empty`` and ``trace.request_slots_in_use``).
    """
    if test.occupancy is not None:
        return _occupancy_verdict(test.occupancy, test.pools_empty)
    slots = test.request_slots_in_use
    if test.pools_empty is None and slots is None:
        return not_applicable("pools-empty", "the engine cannot report its pools")
    problems = []
    if test.pools_empty is False:
        problems.append("KV blocks or state slots are still allocated")
    if slots:
        problems.append(f"{slots} request slot(s) are still in use")
    if problems:
        return failed("pools-empty", " and ".join(problems) + " after every request finished")
    covered = ["KV-block and state-slot pools"] if test.pools_empty is not None else []
    if slots is not None:
        covered.append("request slots")
    return passed("pools-empty", " and ".join(covered) + " empty at the end")


@check(
    "pools-empty",
    reads=("test",),
    passes_when=(
        "no KV block, state slot or request slot allocated and no request waiting or running once "
        "everything finished, from the instance's `occupancy()` (each pool's used / free counts in the "
        "verdict; a cached block no request references counts as free, so one a finished request still "
        "holds is used), else its `pools_empty()`"
    ),
)
def _pools_empty(c: CheckInputs) -> CheckResult:
    return check_pools_empty(c.test)


def _occupancy_verdict(occ: dict[str, int], pools_empty: bool | None) -> CheckResult:
    """A prefix cache's blocks that no request references any more are free (evictable): "used" counts
    referenced blocks, so a block a finished request still holds fails here."""
    figures = [
        f"{label} {occ[key + '_used']} used / {occ[key + '_free']} free"
        for key, label in OCCUPANCY_POOLS
        if key + "_used" in occ and key + "_free" in occ
    ]
    if occ.get("prefix_cache_queries"):
        figures.append(
            f"prefix cache {occ.get('prefix_cache_hits', 0)} of {occ['prefix_cache_queries']} looked-up "
            "tokens hit"
        )
    problems = [f"{occ[key + '_used']} {label}" for key, label in OCCUPANCY_POOLS if occ.get(key + "_used")]
    problems += [f"{occ[key]} {label}" for key, label in OCCUPANCY_QUEUES if occ.get(key)]
    if pools_empty is False and not problems:
        problems.append("pools_empty() says a pool is still in use")
    if problems:
        return failed("pools-empty", f"still in use after every request finished: {', '.join(problems)}",
                      "after every request finished the engine still holds " + ", ".join(problems)
                      + ("\n  occupancy: " + "; ".join(figures) if figures else ""), occupancy=occ)
    return passed(
        "pools-empty", "empty at the end: " + ("; ".join(figures) or "every pool the engine reports")
    )


def _indent(text: str, by: str = "    ") -> str:
    return "\n".join(by + line for line in text.splitlines())
