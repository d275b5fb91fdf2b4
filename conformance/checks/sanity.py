"""A degenerate model never passes the suite: both engines agreeing on garbage is not conformance."""

from __future__ import annotations

from conformance.results import CheckResult, failed, passed
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
