"""Drafts and drafter inputs, row by row: every drafter (MTP, EAGLE-1/3, n-gram, scripted) is fed and proposes
exactly what the reference engine's does.

``acceptance`` compares the drafts a verify step checked and how many it kept. What the drafter was fed
(``drafter_input_ids``: for MTP and EAGLE the token paired with each kept position's hidden state and the
chained passes' tokens; for the host drafters the token they extend) and what it proposed
(``next_draft_token_ids``) reach the outputs only through the drafts' acceptance, so a drafter fed a wrong
token whose drafts happen to be rejected anyway, or a prompt chunk whose drafter cache entry pairs the wrong
token, passes every other check. Here the rows of both engines are matched by request, kind, first position,
length and whether the row sampled (prompt chunks included: MTP's first pass runs over them), and both lists
must be equal wherever both ran.

Not compared: each request's last row that samples, where it may have finished (the reference engine drafts
nothing for a request that is done, an engine a step ahead may not know it is; an aborted request may have
finished before its abort came), and the rows of an aborted request from the first step its abort could have
reached in either engine.
"""

from __future__ import annotations

from conformance.checks.registry import CheckInputs, check
from conformance.results import CheckResult, failed, not_applicable, passed
from conformance.trace import RowTrace, Trace

FIELDS = ("drafter_input_ids", "next_draft_token_ids")


def _rows(trace: Trace) -> dict[tuple, RowTrace]:
    """Rows by (request, kind, first position, query length, whether it sampled), without each request's
    last sampling row (a recompute's chunk may cover a prompt the other run sampled at its end)."""
    last: dict[str, tuple] = {}
    out: dict[tuple, RowTrace] = {}
    for step in trace.steps:
        for row in step.rows:
            key = (row.request_id, row.kind, row.num_computed_tokens, row.query_len,
                   row.output_token_ids is not None)
            if row.output_token_ids is not None:
                last[row.request_id] = key
            out[key] = row
    for key in last.values():  # it may have finished there (an aborted request too, before the abort came)
        out.pop(key, None)
    return out


def _abort_horizon(trace: Trace, rid: str) -> int | None:
    """The first engine step an abort of ``rid`` may have reached in flight (None: not aborted here)."""
    a = trace.aborts.get(rid)
    return None if a is None else a.step - 1


def check_drafts(reference: Trace, test: Trace, k: int, aborted: set[str] | frozenset = frozenset(),
                 ) -> CheckResult:
    """Per request, per row both engines ran alike: the same drafter inputs and the same next drafts."""
    name = "drafts"
    if not k:
        return not_applicable(name, "no drafter (K=0)")
    ref_rows, test_rows = _rows(reference), _rows(test)
    compared = ids = 0
    for key in sorted(ref_rows.keys() & test_rows.keys()):
        rid = key[0]
        a, b = ref_rows[key], test_rows[key]
        if rid in aborted:
            horizons = [h for h in (_abort_horizon(reference, rid), _abort_horizon(test, rid))
                        if h is not None]
            if horizons and max(a.step, b.step) >= min(horizons):
                continue
        compared += 1
        for field in FIELDS:
            x, y = getattr(a, field), getattr(b, field)
            ids += len(x)
            if x != y:
                _, kind, start, qlen, _ = key
                what = "drafter inputs" if field == "drafter_input_ids" else "next drafts"
                where = f"the {kind} row of positions {start}..{start + qlen - 1}"
                return failed(
                    name,
                    f"request {rid}: {what} {y}, expected {x} ({kind} row at position {start})",
                    f"request {rid}, {where}: the drafter was fed or proposed differently\n"
                    f"  {reference.engine} (engine step {a.step}): {field} = {x}\n"
                    f"  {test.engine} (engine step {b.step}): {field} = {y}\n"
                    f"  the row's input ids {b.input_ids[:16]}, output tokens {b.output_token_ids}, "
                    f"verified drafts {b.draft_token_ids}",
                    rid,
                    position=start,
                    field=field,
                    step=b.step,
                    reference=x,
                    test=y,
                )
    if compared == 0:
        return not_applicable(name, "no row ran alike in both engines")
    return passed(name, f"{compared} rows: drafter inputs and next drafts identical ({ids} ids)")


@check(
    "drafts",
    reads=("ref", "test"),
    needs=("rows", "kind", "num_computed_tokens", "query_len", "output_token_ids", "drafter_input_ids",
           "next_draft_token_ids"),
    passes_when=(
        "every drafter (MTP, EAGLE, n-gram, scripted) was fed the same ids (`drafter_input_ids`: for MTP and "
        "EAGLE the token paired with each kept position, prompt chunks included, and the chained passes' "
        "drafts) and "
        "proposed the same next drafts as the reference's, row by row (rows matched by request, kind, first "
        "position, length and whether they sampled; each request's last sampling row, where it may have "
        "finished, and an aborted request's rows from its abort on are left out)"
    ),
)
def _drafts(c: CheckInputs) -> CheckResult:
    return check_drafts(c.ref, c.test, c.scenario.k, aborted=c.aborted)
