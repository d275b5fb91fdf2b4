"""A degenerate model never passes the suite: both engines agreeing on garbage is not conformance."""

from __future__ import annotations

from conformance.checks.registry import CheckInputs, check
from conformance.results import CheckResult, failed, not_applicable, passed
from conformance.trace import Trace

MIN_TOKENS_FOR_DEGENERATE = 8  # fewer output tokens in all say too little to call a model degenerate


def check_degenerate_run(ref: Trace, test: Trace) -> CheckResult:
    """Fails on non-finite verify logits in either engine, and on a reference run whose every request
    emitted one and the same token over and over (what NaN or constant weights produce)."""
    name = "degenerate-run"
    for trace in (ref, test):
        for step in trace.steps:
            for row in step.rows:
                if row.logits_finite is False:
                    return failed(
                        name,
                        f"{trace.engine}: non-finite logits for request {row.request_id} at engine "
                        f"step {step.index}",
                        request_id=row.request_id,
                        step=step.index,
                    )
    outputs = [r.token_ids for r in ref.requests.values() if r.token_ids]
    tokens = {t for out in outputs for t in out}
    total = sum(len(out) for out in outputs)
    if len(tokens) == 1 and total >= MIN_TOKENS_FOR_DEGENERATE:
        token = next(iter(tokens))
        return failed(
            name,
            f"the reference run is degenerate: all {len(outputs)} request(s) emitted only token "
            f"{token} ({total} tokens); the model, not the engine under test, is broken",
            request_id=None,
            token=token,
        )
    checked = sum(row.logits_finite is not None for t in (ref, test) for s in t.steps for row in s.rows)
    return passed(name, f"{len(tokens)} distinct output tokens; {checked} rows' verify logits finite")


@check(
    "degenerate-run",
    reads=("ref", "test"),
    passes_when=(
        "no verify logits that are not finite in either engine, and a reference run that is not one token "
        "repeated for every request (NaN or constant weights): a broken model never passes"
    ),
)
def _degenerate_run(c: CheckInputs) -> CheckResult:
    return check_degenerate_run(c.ref, c.test)


def check_output_records(test: Trace) -> CheckResult:
    """Every request's output is what the engine's own step records say it produced: its output tokens
    are, in order, the output tokens of its rows (a row may record tokens past the end of the output,
    e.g. after a stop token inside a verified window). An engine whose outputs disagree with its records
    (tokens handed to the wrong request, records of another run) cannot have its steps checked at all."""
    from conformance.checks.compare import first_difference, recorded_tokens

    name = "output-records"
    if not test.steps:
        return not_applicable(name, "the engine under test gave no step records")
    for rid in sorted(test.requests):
        req = test.requests[rid]
        recorded = recorded_tokens(test, rid)
        shown = [t for _, t in recorded[: len(req.token_ids)]]
        pos = first_difference(req.token_ids, shown)
        if pos is None:
            continue
        if pos >= len(shown):
            what = (f"its output has {len(req.token_ids)} tokens, but its step records show only "
                    f"{len(recorded)} produced")
        else:
            what = (f"output position {pos} is token {req.token_ids[pos]}, but the engine's step record of "
                    f"engine step {recorded[pos][0]} shows token {shown[pos]} there")
        more = " ..." if len(req.token_ids) > pos + 8 else ""
        report = (f"request {rid}: {what}.\n"
                  f"  output       : {req.token_ids[:pos + 8]}{more}\n"
                  f"  step records : {shown[:pos + 8]}{' ...' if len(shown) > pos + 8 else ''}\n"
                  "The engine's outputs must be the tokens its steps produced; the per-step checks read the "
                  "records, so they say nothing about this output.")
        return failed(name, f"request {rid}: {what}", report, rid, position=pos,
                      step=recorded[pos][0] if pos < len(recorded) else None)
    total = sum(len(r.token_ids) for r in test.requests.values())
    return passed(name, f"{len(test.requests)} requests' {total} output tokens match the engine's step "
                  "records")


@check(
    "output-records",
    reads=("test",),
    needs=("rows", "output_token_ids"),
    passes_when=(
        "every request's output is what the engine's own step records show its rows produced, in order (a "
        "record may run past the end of the output, e.g. after a stop token inside a verified window): an "
        "engine that hands tokens to the wrong request fails"
    ),
)
def _output_records(c: CheckInputs) -> CheckResult:
    return check_output_records(c.test)
