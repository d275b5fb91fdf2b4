"""Checks of the state requests carry (their SamplingParams fields): logprobs, stop semantics, and that
every parameter changes something.

``logprobs`` holds the engine under test's logprobs to the reference's bitwise (ids, order and values)
wherever the tokens are the reference's, prompt logprobs at every prompt position; ``stop-semantics``
what a finished request says about why it finished (vLLM's ``finish_reason`` / ``stop_reason``) and
that nothing past a stop comes back;
``params-change-output`` runs the reference on the same requests without their parameters, so a
parameter both engines silently ignore fails (as vLLM's async-scheduling test asserts).
"""

from __future__ import annotations

from conformance.checks.compare import first_difference
from conformance.checks.registry import CheckInputs, check
from conformance.results import CheckResult, failed, not_applicable, passed
from conformance.trace import RequestTrace, Trace


def _specs(c: CheckInputs) -> dict:
    return {r.request_id: r for r in c.scenario.requests}


def check_logprobs(scenario, reference: Trace, test: Trace, skip=frozenset()) -> CheckResult:
    """A request that asked for logprobs gets one entry per output token holding its token, and the
    entries equal the reference's bitwise over the tokens both produced alike; one that did not, none."""
    name = "logprobs"
    asked = {r.request_id: r.sampling.get("logprobs") for r in scenario.requests}
    asked_prompt = {r.request_id: r.sampling.get("prompt_logprobs") for r in scenario.requests}
    if not any(n is not None for n in (*asked.values(), *asked_prompt.values())):
        return not_applicable(name, "no request asks for logprobs or prompt logprobs")
    prompt_compared = 0
    for rid in sorted(reference.requests):
        ref, got = reference.requests[rid], test.requests.get(rid)
        if got is None:
            continue
        bad, compared_here = _prompt_fault(rid, asked_prompt.get(rid), ref, got, reference, test, rid in skip)
        if bad is not None:
            return bad
        prompt_compared += compared_here
    compared = 0
    for rid in sorted(reference.requests):
        ref, got = reference.requests[rid], test.requests.get(rid)
        if got is None:
            continue
        n = asked.get(rid)
        for side, trace, req in (("reference", reference, ref), ("engine under test", test, got)):
            bad = _malformed(req, n)
            if bad:
                return failed(name, f"request {rid}: {side}'s logprobs {bad}",
                              f"request {rid} (logprobs={n}) on {trace.engine}: its logprobs {bad}",
                              request_id=rid)
        if n is None:
            continue
        same = first_difference(ref.token_ids, got.token_ids)
        upto = min(len(ref.token_ids), len(got.token_ids)) if same is None else same
        if rid in skip:  # an aborted request: over the tokens both kept
            upto = min(upto, len(ref.token_ids), len(got.token_ids))
        for pos in range(upto):
            want, have = ref.logprobs[pos], got.logprobs[pos]
            if [[t, _bits(v)] for t, v in want] != [[t, _bits(v)] for t, v in have]:
                return failed(
                    name, f"request {rid}: logprobs differ at output position {pos} "
                    f"(token {ref.token_ids[pos]})",
                    f"request {rid} output position {pos}, token {ref.token_ids[pos]}:\n"
                    f"  {reference.engine}: {want}\n  {test.engine}: {have}",
                    request_id=rid, position=pos)
        compared += upto
    return passed(name, f"{compared} output tokens' and {prompt_compared} prompt tokens' logprobs bitwise "
                  "equal")


def _prompt_fault(rid: str, n: int | None, ref: RequestTrace, got: RequestTrace, reference: Trace,
                  test: Trace, aborted: bool) -> tuple[CheckResult | None, int]:
    """(A failure or None, prompt positions compared): vLLM's prompt logprobs, None first, then one entry
    per prompt token holding it (top-n plus it), bitwise equal to the reference's; none when not asked.
    An aborted request may come back before its prompt was complete: compared over the entries both have."""
    name = "logprobs"
    for side, trace, req in (("reference", reference, ref), ("engine under test", test, got)):
        why = _prompt_malformed(req, n, aborted)
        if why:
            return failed(name, f"request {rid}: {side}'s prompt logprobs {why}",
                          f"request {rid} (prompt_logprobs={n}) on {trace.engine}: its prompt logprobs {why}",
                          request_id=rid), 0
    if n is None:
        return None, 0
    want, have = ref.prompt_logprobs, got.prompt_logprobs
    upto = min(len(want), len(have))
    if len(want) != len(have) and not aborted:
        return failed(name, f"request {rid}: {len(have)} prompt logprobs entries, the reference {len(want)}",
                      f"request {rid} on {test.engine}: {len(have)} prompt logprobs entries, on "
                      f"{reference.engine} {len(want)}", request_id=rid), 0
    for pos in range(1, upto):
        if [[t, _bits(v)] for t, v in want[pos]] != [[t, _bits(v)] for t, v in have[pos]]:
            return failed(
                name, f"request {rid}: prompt logprobs differ at prompt position {pos} "
                f"(token {ref.prompt_token_ids[pos]})",
                f"request {rid} prompt position {pos}, token {ref.prompt_token_ids[pos]}:\n"
                f"  {reference.engine}: {want[pos]}\n  {test.engine}: {have[pos]}",
                request_id=rid, position=pos), 0
    return None, max(upto - 1, 0)


def _prompt_malformed(req: RequestTrace, n: int | None, aborted: bool) -> str | None:
    entries, prompt = req.prompt_logprobs, req.prompt_token_ids
    if n is None:
        return None if entries is None else f"came back ({len(entries)} entries) though none were asked for"
    if entries is None:
        return "are missing"
    if len(entries) != len(prompt) and not (aborted and len(entries) < len(prompt)):
        return f"have {len(entries)} entries for {len(prompt)} prompt tokens"
    if entries and entries[0] is not None:
        return "do not start with None (the first prompt token has no prefix)"
    for pos in range(1, len(entries)):
        ids = [i for i, _ in entries[pos] or ()]
        if prompt[pos] not in ids:
            return f"at prompt position {pos} lack the prompt token {prompt[pos]}"
        if len(set(ids)) != len(ids) or not n <= len(ids) <= n + 1:
            return f"at prompt position {pos} hold {len(ids)} ids, not the top {n} and the prompt token"
    return None


def _bits(v: float) -> str:
    return float(v).hex()


def _malformed(req: RequestTrace, n: int | None) -> str | None:
    if n is None:
        return None if not req.logprobs else (
            f"came back ({len(req.logprobs)} entries) though none were asked for")
    if req.logprobs is None:
        return "are missing"
    if len(req.logprobs) != len(req.token_ids):
        return f"have {len(req.logprobs)} entries for {len(req.token_ids)} output tokens"
    for pos, (t, entry) in enumerate(zip(req.token_ids, req.logprobs)):
        ids = [i for i, _ in entry]
        if t not in ids:
            return f"at output position {pos} lack the chosen token {t}"
        if len(set(ids)) != len(ids) or not n <= len(ids) <= n + 1:
            return f"at output position {pos} hold {len(ids)} ids, not the top {n} and the chosen token"
    return None


@check(
    "logprobs",
    reads=("ref", "test"),
    needs=("logprobs",),
    passes_when=(
        "a request asking for logprobs gets one entry per output token holding that token (top-n plus the "
        "chosen one), bitwise equal to the reference's (ids, order and values) wherever the tokens are the "
        "reference's; one asking for prompt logprobs gets None then one entry per prompt token holding it "
        "(top-n plus the token), bitwise equal to the reference's; a request not asking gets none"
    ),
)
def _logprobs(c: CheckInputs) -> CheckResult:
    return check_logprobs(c.scenario, c.ref, c.test, c.aborted)


def check_stop_semantics(scenario, reference: Trace, test: Trace, skip=frozenset()) -> CheckResult:
    """``finish_reason`` and ``stop_reason`` as vLLM's: a stop id that finished a request is its last token,
    a stop string ends the text (included or not as asked) and no stop string ends earlier in it, a length
    stop came at ``max_tokens`` (or ``max_model_len``) with no stop string in the text; and equal to the
    reference's."""
    name = "stop-semantics"
    specs = {r.request_id: r for r in scenario.requests}
    max_len = scenario.settings.max_model_len
    judged = 0
    for rid in sorted(test.requests):
        if rid in skip or rid not in specs:
            continue
        got, spec = test.requests[rid], specs[rid]
        ref = reference.requests.get(rid)
        why = _stop_fault(spec, got, max_len)
        if why is None and ref is not None and (ref.finish_reason, ref.stop_reason) != (got.finish_reason,
                                                                                        got.stop_reason):
            why = (f"finished {got.finish_reason!r} / stop_reason {got.stop_reason!r}, the reference "
                   f"{ref.finish_reason!r} / {ref.stop_reason!r}")
        if why is not None:
            return failed(name, f"request {rid}: {why}",
                          f"request {rid} ({len(got.token_ids)} output tokens, text {got.text!r}) on "
                          f"{test.engine}: {why}", request_id=rid)
        judged += 1
    return passed(name, f"{judged} requests' finish and stop reasons as vLLM's, nothing past a stop")


def _stop_fault(spec, got: RequestTrace, max_len: int | None) -> str | None:
    p = spec.sampling
    stops, reason, tokens = tuple(p.get("stop") or ()), got.stop_reason, got.token_ids
    if got.finish_reason == "length":
        if reason is not None:
            return f"finished 'length' with stop_reason {reason!r}"
        full = max_len is not None and len(got.prompt_token_ids) + len(tokens) >= max_len
        if len(tokens) != spec.max_tokens and not full:
            return f"finished 'length' after {len(tokens)} of max_tokens={spec.max_tokens} tokens"
    elif got.finish_reason == "stop":
        if len(tokens) < p.get("min_tokens", 0):
            return f"stopped after {len(tokens)} tokens, under min_tokens={p['min_tokens']}"
        if isinstance(reason, str):
            if reason not in stops:
                return f"stop_reason {reason!r} is none of its stop strings {list(stops)}"
            if got.text is not None and p.get("include_stop_str_in_output") and not got.text.endswith(reason):
                return f"the text does not end with its stop string {reason!r} (include_stop_str_in_output)"
        elif reason is not None:
            if reason not in spec.stop_token_ids:
                return f"stop_reason {reason!r} is none of its stop_token_ids {list(spec.stop_token_ids)}"
            if not tokens or tokens[-1] != reason:
                return f"stop_reason {reason} is not its last token ({tokens[-1:]})"
        elif spec.ignore_eos and not p.get("structured_outputs"):  # a grammar's end stops whatever it says
            return "finished 'stop' on EOS with ignore_eos (stop_reason None)"
    elif got.finish_reason != "abort":
        return f"finish_reason {got.finish_reason!r} is none of 'stop', 'length'"
    if got.logprobs is not None and len(got.logprobs) != len(tokens):
        return f"{len(got.logprobs)} logprobs entries for {len(tokens)} output tokens"
    if stops and got.text is not None and not p.get("min_tokens"):
        text = got.text
        kept = isinstance(reason, str) and p.get("include_stop_str_in_output")
        limit = len(text) if kept else len(text) + 1
        for s in stops:
            at = text.find(s)
            if at != -1 and at + len(s) < limit:
                return f"its text holds stop string {s!r} ending at character {at + len(s)}, before its end"
    return None


@check(
    "stop-semantics",
    reads=("ref", "test"),
    needs=("stop_reason",),
    passes_when=(
        "`finish_reason` and `stop_reason` as vLLM's: a stop id that finished a request is its last token "
        "(and in its `stop_token_ids`), a stop string is one of its `stop` and ends the text (with "
        "`include_stop_str_in_output`) and no stop string ends earlier in it, nothing stops under "
        "`min_tokens`, a `length` finish is at `max_tokens` (or `max_model_len`), logprobs end with the "
        "tokens; both equal to the reference's"
    ),
)
def _stop_semantics(c: CheckInputs) -> CheckResult:
    return check_stop_semantics(c.scenario, c.ref, c.test, c.aborted)


def must_change(spec, bare: RequestTrace) -> str | None:
    """Why request ``spec``'s parameters must change the output its run without them gave (``bare``), on
    any model, or None where that is the model's to say (a penalty or a bias moves an argmax only where the
    logits are close enough). From the run without them alone: an output id outside ``allowed_token_ids``
    cannot come back; a stop on an id before ``min_tokens`` is held back; a stop string in the text ends
    it (without ``min_tokens``, which holds stop strings back too)."""
    p, tokens = spec.sampling, bare.token_ids
    allowed = p.get("allowed_token_ids")
    if allowed is not None:
        outside = [(i, t) for i, t in enumerate(tokens) if t not in set(allowed)]
        if outside:
            return f"its output without them has id {outside[0][1]} at position {outside[0][0]}, outside " \
                   "allowed_token_ids"
    m = p.get("min_tokens", 0)
    if m and bare.finish_reason == "stop" and not isinstance(bare.stop_reason, str) and len(tokens) <= m:
        return f"without them it stops on an id after {len(tokens)} tokens, which min_tokens={m} holds back"
    text = bare.text
    for stop in () if m or text is None else p.get("stop") or ():
        at = text.find(stop)
        if at != -1 and (at + len(stop) < len(text) or bare.finish_reason == "length"):
            return f"its text without them holds its stop string {stop!r}"
    return None


def check_params_change_output(scenario, reference: Trace, bare: Trace | None,
                               skip=frozenset(), require_exercised: bool = False) -> CheckResult:
    """Every request whose parameters can change its tokens has another output (tokens, finish reason or
    text) than the same request without them; every request without such parameters has the same one.

    A request whose parameters changed nothing fails where they must have changed it on any model
    (``must_change``: a parameter was ignored); elsewhere the model decides (a penalty that moves no argmax
    on this checkpoint), and the request is "not exercised": a warning naming it, the check passes on the
    others, and ``require_exercised`` (``--require-exercised``: a gate asking for every one) makes it fail;
    each such request is a named gap (``details["gaps"]``: its parameters, and why they may not matter).
    Sampled requests are held as a whole: a draw may come out greedy by chance, so one of them at least
    must differ (a temperature both engines ignore fails)."""
    name = "params-change-output"
    if bare is None:
        return not_applicable(name, "no request carries a parameter that changes its tokens")
    if bare.error is not None:
        return not_applicable(name, "the reference run without the parameters broke")
    changed = same = 0
    sampled: list[str] = []
    sampled_changed = 0
    unproven: list[str] = []
    for r in scenario.requests:
        rid = r.request_id
        if rid in skip or rid not in reference.requests or rid not in bare.requests:
            continue
        a, b = reference.requests[rid], bare.requests[rid]
        differs = (a.token_ids, a.finish_reason, a.text) != (b.token_ids, b.finish_reason, b.text)
        if r.samples:
            sampled.append(rid)
            sampled_changed += differs
            continue
        if r.restricted and not differs:
            why = must_change(r, b)
            if why is None and not require_exercised:
                unproven.append(rid)
                continue
            return failed(
                name, f"request {rid}: its parameters were ignored: {why}" if why else
                f"request {rid}: its parameters changed nothing, and the run asks that each one matter "
                "(--require-exercised)",
                f"request {rid} with {r.sampling} gives the reference's output without them too "
                f"({len(a.token_ids)} tokens, finish {a.finish_reason!r}): "
                + (f"{why}, so on any model they must change it" if why else
                   "a parameter both engines ignored would pass the comparison, so the scenario must make "
                   "each one matter"),
                request_id=rid)
        if not r.restricted and differs:
            pos = first_difference(a.token_ids, b.token_ids)
            return failed(
                name, f"request {rid}: it has no parameters, yet its neighbours' changed its output",
                f"request {rid} (no parameters) differs from the same request in the run without any "
                f"parameters at output position {pos}: one request's parameters reached another's logits",
                request_id=rid)
        changed += r.restricted
        same += not r.restricted
    if sampled and not sampled_changed:
        return failed(name, f"none of the {len(sampled)} sampled requests differs from greedy decoding",
                      f"requests {', '.join(sampled[:8])}{' ...' if len(sampled) > 8 else ''} sample "
                      "(temperature > 0), yet each gives the reference's output without parameters: a "
                      "temperature both engines ignored would pass the comparison", request_id=sampled[0])
    tail = f", {sampled_changed} of {len(sampled)} sampled requests differ from greedy" if sampled else ""
    result = passed(name, f"{changed} requests changed by their parameters, {same} without parameters "
                    f"unchanged{tail}")
    if unproven:
        reasons = {rid: _unproven(_spec(scenario, rid)) for rid in unproven}
        listed = "; ".join(f"{rid} ({why})" for rid, why in reasons.items())
        result = not_applicable(name, f"not exercised on this model: the parameters of {', '.join(unproven)} "
                                f"changed nothing ({result.summary})")
        gaps = [{"what": f"request {rid}'s parameters ({_names(scenario, rid)})",
                 "why": why} for rid, why in reasons.items()]
        result.details.update(not_exercised=unproven, reasons=reasons, gaps=gaps, warning=(
            f"scenario {scenario.id}: the parameters of request(s) {listed} changed nothing on this model, "
            "which it may do, so the run does not show that they are applied"))
    return result


def _spec(scenario, rid: str):
    return next(r for r in scenario.requests if r.request_id == rid)


def _names(scenario, rid: str) -> str:
    return ", ".join(n for n, _ in _spec(scenario, rid).params)


# Why a parameter may change nothing on a checkpoint, where ``must_change`` did not show that it must.
_MAY_NOT_MATTER = (
    (("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"),
     "a penalty or a bias moves an argmax only where the logits are close"),
    (("allowed_token_ids",), "every id of its output was allowed anyway"),
    (("min_tokens",), "it stopped no sooner than min_tokens anyway"),
    (("stop",), "its text never held a stop string"),
    (("bad_words",), "its text never held a bad word"),
    (("structured_outputs",), "its output kept to the grammar anyway"),
)


def _unproven(spec) -> str:
    names = {n for n, _ in spec.params}
    return "; ".join(why for group, why in _MAY_NOT_MATTER if names & set(group))


@check(
    "params-change-output",
    reads=("ref", "bare"),
    replay=False,
    passes_when=(
        "every request whose parameters can change its tokens has another output (tokens, finish reason or "
        "text) in the reference run than in the reference run of the same requests without any parameters "
        "(a parameter both engines ignore fails), and every request without such parameters the same one; "
        "sampled requests as a whole (one at least differs: a draw may come out greedy by chance); a request "
        "whose parameters need not change its output on this model (a penalty that moves no argmax; not an "
        "id outside `allowed_token_ids`, a stop before `min_tokens` or a stop string in the text without "
        "them) is *not exercised* (a warning) unless the run asks for every one (`--require-exercised`)"
    ),
)
def _params_change_output(c: CheckInputs) -> CheckResult:
    return check_params_change_output(c.scenario, c.ref, c.bare, c.aborted, c.require_exercised)
