"""The structured-outputs check: every constrained output that completed is in its grammar's language,
judged without xgrammar (the engines' grammar library): a JSON schema by ``json`` + ``jsonschema``, a
regex by ``re.fullmatch``, a choice by membership. An EBNF ``grammar`` has no independent judge here: its
outputs are held to the reference's by the token checks only.

A request completed its grammar when it finished ``stop`` (the grammar's end token); one cut at
``max_tokens`` is a prefix and is not judged. Both runs are judged, the reference too: an engine that
ignores the grammar in both would pass every comparison but not this.
"""

from __future__ import annotations

import json
import re

from conformance.checks.registry import CheckInputs, check
from conformance.results import CheckResult, failed, not_applicable, passed
from conformance.trace import Trace


def _constraint(spec) -> dict | None:
    so = spec.sampling.get("structured_outputs")
    return None if so is None else dict(so)


def violation(constraint: dict, text: str) -> str | None:
    """Why ``text`` is not in the language of ``constraint`` (StructuredOutputsParams fields); None if it is
    (or the constraint has no independent judge)."""
    if constraint.get("json") is not None:
        import jsonschema

        schema = constraint["json"]
        schema = json.loads(schema) if isinstance(schema, str) else schema
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"is not JSON ({exc.msg} at character {exc.pos})"
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as exc:
            return f"does not match its JSON schema: {exc.message}"
        return None
    if constraint.get("regex") is not None:
        return None if re.fullmatch(constraint["regex"], text) else f"does not match /{constraint['regex']}/"
    if constraint.get("choice") is not None:
        choices = list(constraint["choice"])
        return None if text in choices else f"is none of {choices}"
    return None


def check_structured_outputs(scenario, reference: Trace, test: Trace, skip=frozenset()) -> CheckResult:
    name = "structured-outputs"
    judged = 0
    for spec in scenario.requests:
        constraint = _constraint(spec)
        if constraint is None or spec.request_id in skip:
            continue
        for trace in (reference, test):
            got = trace.requests.get(spec.request_id)
            if got is None or got.finish_reason != "stop":
                continue
            if got.text is None:
                return not_applicable(name, f"{trace.engine} reports no output text")
            why = violation(constraint, got.text)
            if why is not None:
                rid = spec.request_id
                return failed(name, f"request {rid}: its output {why} on {trace.engine}",
                              f"request {rid} finished 'stop' (its grammar complete) on {trace.engine} with "
                              f"text {got.text!r}, which {why} (structured_outputs {constraint})",
                              request_id=rid)
            judged += 1
    if not judged:
        return not_applicable(name, "no constrained request completed its grammar")
    return passed(name, f"{judged} completed constrained outputs in their grammar's language")


@check(
    "structured-outputs",
    reads=("ref", "test"),
    needs=("text",),
    passes_when=(
        "every request with `structured_outputs` that finished `stop` has output text in its grammar's "
        "language, judged without xgrammar (`json` + `jsonschema`, `re.fullmatch`, a choice's strings), in "
        "the reference run and the run under test"
    ),
)
def _structured_outputs(c: CheckInputs) -> CheckResult:
    return check_structured_outputs(c.scenario, c.ref, c.test, c.aborted)
