"""The ``rescored`` check, and what each bitwise check becomes under ``--verdict rescored``.

Under ``--verdict rescored`` the reference scores the engine's own output (``conformance.scoring``): each
position's margin is how many nats the engine's token lies below the reference's pick. ``rescored`` fails
on a *structural* divergence (a margin above the calibrated tolerance, ``conformance.verdict``); one within
it is a *near-tie* and passes. Every request's first divergence, worst position and divergences, each
classified, are in its details, so the JSON report holds the whole picture.

Where the engine is not bitwise the reference (another dtype, device or kernels: ``CheckInputs.bitwise``
false) the checks that compare the two engines bitwise cannot hold. ``NOT_BITWISE`` says what each becomes:
n/a with the reason, or a narrower check of what still holds (the engine against its own K=0 run where
it is batch-invariant, the per-engine rules of logprobs and stop reasons, ...). Checks not named there hold
under any verdict and run as they are.

Where the engine declares itself bitwise the reference in its own dtype (the adapter's ``bitwise``) but the
reference scoring it runs in another dtype or on another device (``Verdict.bitwise_in_own_dtype``), those
checks are not given up: each is held, as under the exact verdict, to the reference engine's runs in the
engine's own dtype on its device (``judge``'s ``own``), and says so in its summary and details
(``held_to``). The greedy tokens stay judged by 'rescored'; the seeded draws of sampled requests, which
rescoring does not judge, are held to that reference bitwise ('tokens').
"""

from __future__ import annotations

import math

from conformance.checks.aborts import check_aborts
from conformance.checks.compare import (
    _missing,
    check_request_outputs,
    check_tokens,
    locate,
    token_window,
)
from conformance.checks.params import check_logprobs, check_stop_semantics
from conformance.checks.prefix_cache import check_restored_state
from conformance.checks.registry import Check, CheckInputs, check
from conformance.results import CheckResult, failed, not_applicable, passed

NAME = "rescored"
SHOWN = 8  # divergences listed per request in a report


def _fmt(margin: float) -> str:
    return "inf (its parameters forbid it)" if math.isinf(margin) else f"{margin:.4g}"


def _json_margin(margin: float):
    return "inf" if math.isinf(margin) else round(margin, 6)


def request_summary(score, verdict) -> dict:
    """One request's rescoring, JSON-ready: its first divergence, worst position and margin, and every
    divergence as [position, token, reference pick, margin, "near-tie" | "structural"]."""
    if score.skipped:
        return {"skipped": score.skipped}
    divs = [[i, score.tokens[i], score.argmax[i], _json_margin(score.margins[i]),
             verdict.classify(score.margins[i])] for i in score.divergences()]
    worst = score.worst()
    return {"positions": len(score.margins), "first_divergence": divs[0][0] if divs else None,
            "worst_position": worst,
            "worst_margin": None if worst is None else _json_margin(score.margins[worst]),
            "structural": sum(d[4] == "structural" for d in divs),
            "near_ties": sum(d[4] == "near-tie" for d in divs), "divergences": divs}


def check_rescored(c: CheckInputs) -> CheckResult:
    verdict = c.verdict
    if verdict is None or not verdict.rescored:
        return not_applicable(NAME, "verdict exact: the tokens are compared bitwise ('tokens')")
    if (missing := _missing(NAME, c.ref, c.test)) is not None:
        return missing
    scores = (c.scores or {}).get("test", {})
    summaries = {rid: request_summary(s, verdict) for rid, s in sorted(scores.items())}
    scored = [s for s in scores.values() if not s.skipped]
    structural = [(rid, s) for rid, s in sorted(scores.items()) if not s.skipped and any(
        verdict.classify(m) == "structural" for m in s.margins)]
    details = {"tolerance": verdict.tolerance, "reference_dtype": verdict.reference_dtype,
               "requests": summaries}
    if verdict.bitwise_in_own_dtype:  # the bitwise checks are held to the reference in the engine's dtype
        details["bitwise_checks_held_to"] = verdict.dtype
    positions = sum(len(s.margins) for s in scored)
    near = [m for s in scored for m in s.margins if verdict.classify(m) == "near-tie"]
    skipped = len(scores) - len(scored)
    tail = f"; {skipped} sampled request(s) not rescored (judged in distribution)" if skipped else ""
    if not structural:
        worst = f" (worst {max(near):.4g} nats)" if near else ""
        return CheckResult(NAME, "pass", f"{len(scored)} requests, {positions} positions within "
                           f"{verdict.tolerance:.4g} nats of the pick of the reference in "
                           f"{verdict.reference_dtype}: {len(near)} near-tie(s){worst}, none "
                           f"structural{tail}{_held_tail(verdict)}", details=details)
    rid, s = structural[0]
    return _failure(c, rid, s, structural, details)


def _held_tail(verdict) -> str:
    if not verdict.bitwise_in_own_dtype:
        return ""
    return (f"; the bitwise checks held to the reference engine in {verdict.dtype}, the engine's own dtype, "
            "in which it declares itself bitwise the reference")


def _failure(c: CheckInputs, rid: str, s, structural, details: dict) -> CheckResult:
    verdict, req = c.verdict, c.test.requests[rid]
    worst = s.worst()
    divs = s.divergences()
    first = divs[0]
    bad = [i for i in divs if verdict.classify(s.margins[i]) == "structural"]
    head = (f"request {rid} ({len(req.prompt_token_ids)}-token prompt): {len(bad)} structural and "
            f"{len(divs) - len(bad)} near-tie divergence(s) over {len(s.margins)} positions (tolerance "
            f"{verdict.tolerance:.4g} nats, reference in {verdict.reference_dtype})")
    lines = [head]
    for label, i in (("first divergence", first), ("worst", worst)):
        lines.append(f"  {label} at output position {i}: engine token {s.tokens[i]}, the reference's pick "
                     f"{s.argmax[i]}, {_fmt(s.margins[i])} nats below it: {verdict.classify(s.margins[i])}; "
                     f"{locate(req, i, c.test)}")
    lines.append(f"  {c.test.engine} : {token_window(s.tokens, bad[0])}  (position {bad[0]}, the first "
                 "structural one)")
    shown = ", ".join(f"{i} ({verdict.classify(s.margins[i])} {_fmt(s.margins[i])})" for i in divs[:SHOWN])
    lines.append(f"  divergences: {shown}" + (" ..." if len(divs) > SHOWN else ""))
    if len(structural) > 1:
        lines.append(f"  {len(structural)} requests have structural divergences; the others: "
                     + ", ".join(r for r, _ in structural[1:9]))
    blame = _speculation_blame(c, rid)
    if blame:
        lines.append("  " + blame)
    pos = bad[0]
    steps = req.token_steps
    return failed(NAME, f"request {rid}: output position {pos} is {_fmt(s.margins[pos])} nats below the "
                  f"reference's pick (tolerance {verdict.tolerance:.4g}): structural", "\n".join(lines), rid,
                  position=pos, step=steps[pos] if pos < len(steps) else None, **details)


def _speculation_blame(c: CheckInputs, rid: str) -> str:
    """With speculation on: whether the engine's own K=0 run is clean at the same tolerance."""
    plain = (c.scores or {}).get("test-plain")
    if not c.scenario.k or plain is None or rid not in plain:
        return ""
    s = plain[rid]
    if s.skipped:
        return ""
    worst = s.worst()
    if worst is None or c.verdict.classify(s.margins[worst]) != "structural":
        return ("with speculation off (K=0) the engine under test has no structural divergence in this "
                "request: speculative decoding is why")
    return ("with speculation off (K=0) the engine under test diverges structurally too (output position "
            f"{worst}, {_fmt(s.margins[worst])} nats): the bug is not in speculative decoding")


@check(
    "rescored",
    reads=("test", "scored"),
    passes_when=(
        "under `--verdict rescored`: at every output position of every greedy request the engine's token is "
        "the reference's pick (the reference in `--reference-dtype` scoring the engine's own output, one "
        "teacher-forced prefill per request, the request's parameters applied) or within the calibrated "
        "tolerance of it (a near-tie); a token further below is structural and fails; n/a under `exact`"
    ),
)
def _rescored(c: CheckInputs) -> CheckResult:
    return check_rescored(c)


# ---- the bitwise checks where the engine is not bitwise the reference -------------------------------------
WHY = "verdict rescored, the engine is not bitwise the reference here (another dtype, device or kernels)"


def _spec_lossless(c: CheckInputs) -> CheckResult:
    name = "spec-lossless"
    if not c.scenario.k:
        return not_applicable(name, "K=0: no speculation to compare")
    sampled = {r.request_id for r in c.scenario.requests if r.samples}
    if not c.batch_invariant:
        return not_applicable(name, f"{WHY}, nor batch-invariant: its K=0 run may differ from its K>0 run by "
                              "near-ties; its K>0 output is judged by 'rescored' (which says on a structural "
                              "divergence whether its K=0 run has one too)")
    if c.test_plain is None or c.test_plain.error is not None:
        return not_applicable(name, "no K=0 run of the engine under test to compare with")
    result = check_tokens(c.test_plain, c.test, name=name, skip=c.aborted | sampled)
    if result.failed:
        result.report = ("speculative decoding changed the output: the engine under test (batch-invariant, "
                         "so bitwise against itself) gives other tokens with K=0\n" + result.report)
    else:
        result.summary += " to the engine's own K=0 run (it is batch-invariant: bitwise against itself)"
    return result


def _aborts(c: CheckInputs) -> CheckResult:
    name = "aborts"
    if not c.scenario.aborted:
        return not_applicable(name, "the workload aborts no request")
    ref = check_aborts(c.scenario, c.ref, c.ref, c.plain)
    if ref.failed or ref.status == "n/a":
        return ref
    if c.batch_invariant and c.test_plain is not None and c.test_plain.error is None:
        own = check_aborts(c.scenario, c.test, c.test, c.test_plain)
        if own.failed:
            own.report = ("held to the engine under test's own un-aborted K=0 run (it is batch-invariant)\n"
                          + own.report)
            return own
        return passed(name, f"{len(c.scenario.aborted)} aborted request(s): each the reference's a prefix of "
                      "its un-aborted run, each the engine under test's a prefix of its own un-aborted K=0 "
                      "run (it is batch-invariant)")
    return passed(name, f"{len(c.scenario.aborted)} aborted request(s): each the reference's a prefix of its "
                  "un-aborted run; the engine under test's are judged by 'rescored' token by token "
                  f"({WHY}, nor batch-invariant)")


def _logprobs(c: CheckInputs) -> CheckResult:
    result = check_logprobs(c.scenario, c.test, c.test, c.aborted)  # the rules on the engine's own entries
    if result.status == "pass":
        result.summary = ("the engine's logprobs well formed (one entry per token holding it, top-n, prompt "
                          f"logprobs per prompt token); values not compared with the reference's: {WHY}")
    return result


def _stop_semantics(c: CheckInputs) -> CheckResult:
    result = check_stop_semantics(c.scenario, c.test, c.test, c.aborted)  # vLLM's rules on the engine's own
    if result.status == "pass":
        result.summary += ("; finish and stop reasons not compared with the reference's: where each output "
                           "ends is judged by 'rescored'")
    return result


def _restored_state(c: CheckInputs) -> CheckResult:
    result = check_restored_state(c.scenario, c.ref, c.test, batch_invariant=False)
    if result.status == "pass":
        result.summary += f"; first logits not compared with the uncached reference's bitwise: {WHY}"
    return result


def _request_outputs(c: CheckInputs) -> CheckResult:
    """Prompts compared where they must be equal: a next turn holds its earlier turn's output, which may
    differ from the reference's."""
    differ = set()
    for r in c.scenario.requests:
        src = r.extends
        a, b = c.ref.requests.get(src), c.test.requests.get(src)
        if src is not None and (a is None or b is None or (a.prompt_token_ids, a.token_ids)
                                != (b.prompt_token_ids, b.token_ids)):
            differ.add(r.request_id)
    result = check_request_outputs(c.ref, c.test, c.scenario.k, skip_prompts=differ)
    if result.status == "pass" and differ:
        result.summary += (f"; {len(differ)} next turn(s) whose earlier turn's output differs from the "
                           "reference's: their prompts not compared")
    return result


# Check name -> under --verdict rescored where the engine is not bitwise the reference: the reason it is
# n/a, or what it checks instead.
NOT_BITWISE = {
    "tokens": f"{WHY}: tokens are judged by 'rescored' (the reference scores the engine's own output)",
    "acceptance": f"{WHY}: its drafts follow its own tokens and dtype; every draft it accepted is an output "
                  "token 'rescored' judges",
    "drafts": f"{WHY}: its drafter's inputs and proposals follow its own tokens and dtype",
    "logits-digests": f"{WHY}: its logits are not bitwise the reference's",
    "spec-lossless": _spec_lossless,
    "aborts": _aborts,
    "logprobs": _logprobs,
    "stop-semantics": _stop_semantics,
    "restored-state": _restored_state,
    "request-outputs": _request_outputs,
}


# ---- the bitwise checks held to the reference in the engine's own dtype -----------------------------------
def held_note(c: CheckInputs) -> str:
    """What holding a check to the reference in the engine's own dtype means, in words (``c``: the held
    inputs, whose verdict is the engine's own dtype's)."""
    return (f"held to the reference engine in {c.verdict.dtype}, the engine's own dtype, in which it "
            "declares itself bitwise the reference")


def _seeded_tokens(c: CheckInputs, own: CheckInputs) -> CheckResult:
    """'tokens' where held: the greedy tokens are judged by 'rescored'; the sampled requests' seeded draws,
    which rescoring does not judge, are held bitwise to the reference in the engine's dtype."""
    name = "tokens"
    sampled = {r.request_id for r in c.scenario.requests if r.samples} - c.aborted
    greedy = f"greedy tokens judged by 'rescored' (the reference in {c.verdict.reference_dtype} scores them)"
    if not sampled:
        return not_applicable(name, f"{greedy}; no sampled request whose seeded draws to hold to the "
                              f"reference engine in the engine's own dtype, {c.verdict.dtype}")
    skip = {r.request_id for r in c.scenario.requests} - sampled
    result = check_tokens(own.ref, own.test, name=name, skip=skip)
    if result.status == "pass":
        result.summary = (f"{len(sampled)} sampled request(s)' seeded draws identical, {held_note(own)}; "
                          f"{greedy}")
    return result


def _held(c: Check, inputs: CheckInputs, own: CheckInputs) -> CheckResult:
    if c.name == "tokens":
        result = _seeded_tokens(inputs, own)
    else:
        result = c.fn(own)
    if result.status == "n/a":
        return result
    note = held_note(own)
    if note not in result.summary:
        result.summary += f" ({note})"
    if result.failed:
        result.report = f"{note}:\n{result.report}" if result.report else note
    result.details.setdefault("held_to", {"reference_dtype": own.verdict.dtype,
                                          "why": "the engine declares itself bitwise the reference in its "
                                                 "own dtype"})
    return result


def judge(c: Check, inputs: CheckInputs, own: CheckInputs | None = None) -> CheckResult:
    """Check ``c`` over ``inputs`` under the run's verdict. ``own``: the same inputs with the reference
    engine's runs in the engine's own dtype, where the verdict holds the bitwise checks to them
    (``Verdict.bitwise_in_own_dtype``)."""
    if inputs.bitwise or c.name not in NOT_BITWISE:
        return c.fn(inputs)
    if own is not None and inputs.verdict.bitwise_in_own_dtype:
        return _held(c, inputs, own)
    rule = NOT_BITWISE[c.name]
    return not_applicable(c.name, rule) if isinstance(rule, str) else rule(inputs)
