"""What an aborted request's output is, in each engine.

The workload aborts a request before engine step s (``RequestSpec.abort_step``) unless its output has
come back by then. Outputs only come back when a request finishes, so nothing a user saw earlier
pins how many tokens an aborted request keeps: an async engine, one step behind, has committed
fewer than a synchronous one at the same call. What is pinned down, for each engine on its own:

- finish reason ``abort``: ``token_ids`` is a prefix (possibly empty) of the request's un-aborted
  continuation, the plain run's output (the reference engine, K=0, the same workload without aborts);
  the speculative counters describe only what was verified (the "request-outputs" check);
- any other finish reason (the request had finished inside the engine before the abort reached it):
  the full un-aborted output and the same finish reason as the plain run;
- after the abort call, no step record delivered later has a row for it, the step that was in
  flight when the abort came included: its work for the request is discarded, never committed or
  shown;
- right after the abort call the engine holds no queue entry for it: its ``occupancy()`` counts as
  many waiting and running requests as the harness has added and not got back (where the engine
  reports occupancy), so its slots and blocks are free before the next step.

Across the two engines only the prefix property is compared, not the token counts. That the abort
has no effect on other requests is the "tokens" check (every other request equals the reference),
and that its blocks and slots are freed is "pools-empty".
"""

from __future__ import annotations

from conformance.checks.compare import first_difference, token_window
from conformance.checks.registry import CheckInputs, check
from conformance.results import CheckResult, failed, not_applicable, passed
from conformance.trace import Trace
from conformance.workloads.scenario import Scenario


def check_aborts(scenario: Scenario, reference: Trace, test: Trace, plain: Trace | None) -> CheckResult:
    name = "aborts"
    if not scenario.aborted:
        return not_applicable(name, "the workload aborts no request")
    if plain is None:
        return not_applicable(name, "no un-aborted run to compare with")
    kept = []
    for trace in (reference, test):
        for rid in scenario.aborted:
            full = plain.requests.get(rid)
            got = trace.requests.get(rid)
            if full is None:
                return not_applicable(name, f"the plain run never finished request {rid}")
            if got is None:
                return failed(
                    name,
                    f"request {rid}: {trace.engine} never returned an output for it",
                    request_id=rid,
                    engine=trace.engine,
                )
            problem = _problem(got.token_ids, got.finish_reason, full.token_ids, full.finish_reason)
            if problem:
                pos = first_difference(got.token_ids, full.token_ids)
                pos = 0 if pos is None else pos
                abort = trace.aborts.get(rid)
                when = (f"aborted before engine step {abort.step}" if abort is not None else
                        "the harness never had to abort it (its output came back first)")
                return failed(
                    name,
                    f"request {rid}: {trace.engine} {problem}",
                    f"request {rid} ({when}) in {trace.engine}: {problem}\n"
                    f"  {trace.engine} : {token_window(got.token_ids, pos)} (finish {got.finish_reason!r})\n"
                    f"  un-aborted   : {token_window(full.token_ids, pos)} (finish "
                    f"{full.finish_reason!r}; reference engine, K=0, no aborts)",
                    rid,
                    engine=trace.engine,
                    position=pos,
                )
            late = _scheduled_after_abort(trace, rid)
            if late is not None:
                return failed(
                    name,
                    f"request {rid}: {trace.engine} shows it in engine step {late} after aborting it",
                    f"request {rid} was aborted after {trace.aborts[rid].records_before} step records, "
                    f"but step record {late}, delivered after the abort, still has a row for it: work "
                    f"for an aborted request must be discarded, also that of a step already in flight",
                    rid,
                    engine=trace.engine,
                    step=late,
                )
            abort = trace.aborts.get(rid)
            if abort is not None and abort.queued is not None and abort.queued != abort.live:
                return failed(
                    name,
                    f"request {rid}: {trace.engine} still queues it after abort()",
                    f"right after abort({rid!r}) the engine reported {abort.queued} waiting + running "
                    f"requests, but only {abort.live} are live (added and not returned)",
                    rid,
                    engine=trace.engine,
                )
            kept.append(f"{trace.engine} {rid} {len(got.token_ids)}/{len(full.token_ids)}"
                        + ("" if got.finish_reason == "abort" else f" ({got.finish_reason})"))
    return passed(
        name,
        f"{len(scenario.aborted)} aborted request(s), each a prefix of its un-aborted output: "
        + ", ".join(kept[:6])
        + (" ..." if len(kept) > 6 else ""),
    )


@check(
    "aborts",
    reads=("plain", "ref", "test"),
    passes_when=(
        "each engine's aborted request ends `abort` with a prefix of its un-aborted output (the plain run), "
        "or, if it had finished before the abort reached it, with that whole output; it is never scheduled "
        "again after the step in flight"
    ),
)
def _aborts(c: CheckInputs) -> CheckResult:
    return check_aborts(c.scenario, c.ref, c.test, c.plain)


def _problem(tokens: list[int], reason: str | None, full: list[int], full_reason: str | None) -> str | None:
    if reason == "abort":
        if tokens != full[: len(tokens)]:
            if len(tokens) > len(full):
                return f"kept {len(tokens)} tokens, more than the {len(full)} of its un-aborted output"
            return f"kept {len(tokens)} tokens that are not a prefix of its un-aborted output"
        return None
    if tokens != full or reason != full_reason:
        return (
            f"finished with {reason!r} after {len(tokens)} tokens instead of being aborted, "
            f"but that is not its un-aborted output ({len(full)} tokens, {full_reason!r})"
        )
    return None


def _scheduled_after_abort(trace: Trace, rid: str) -> int | None:
    abort = trace.aborts.get(rid)
    if abort is None:
        return None
    for step in trace.steps[abort.records_before:]:
        if any(r.request_id == rid for r in step.rows):
            return step.index
    return None
