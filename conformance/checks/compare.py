"""Checks over two traces of the same workload: the reference's and the engine under test's."""

from __future__ import annotations

from conformance.checks.registry import CheckInputs, check
from conformance.results import CheckResult, failed, not_applicable, passed
from conformance.trace import RequestTrace, Trace

WINDOW = 4  # tokens shown on each side of a divergence


def first_difference(a: list, b: list) -> int | None:
    """Index of the first element where ``a`` and ``b`` differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def token_window(tokens: list[int], i: int, width: int = WINDOW) -> str:
    """``... 12 44 [91] 3 8 ...``: the tokens around index ``i``, the one at ``i`` in brackets."""
    lo, hi = max(0, i - width), min(len(tokens), i + width + 1)
    parts = ["..."] if lo > 0 else []
    parts += [f"[{t}]" if j == i else str(t) for j, t in enumerate(tokens[lo:hi], start=lo)]
    if i >= len(tokens):
        parts.append("[end]")
    elif hi < len(tokens):
        parts.append("...")
    return " ".join(parts)


def acceptance_history(acceptance: list[tuple[int, int]], mark: int | None = None, limit: int = 24) -> str:
    """``3/3 3/1 [3/0] 3/2``: drafted/accepted per verify step, step ``mark`` in brackets."""
    if not acceptance:
        return "(no verify steps)"
    items = [f"[{d}/{a}]" if i == mark else f"{d}/{a}" for i, (d, a) in enumerate(acceptance)]
    if len(items) > limit:
        centre = mark if mark is not None else 0
        lo = max(0, min(centre - limit // 2, len(items) - limit))
        items = (["..."] if lo else []) + items[lo:lo + limit] + (["..."] if lo + limit < len(items) else [])
    return " ".join(items)


def recorded_tokens(trace: Trace, request_id: str) -> list[tuple[int, int]]:
    """(engine step, token) of every output token the engine's own step records show for a request, in
    order: the output tokens of its rows (a row's kept tokens, bonus included)."""
    return [(row.step, t) for row in trace.rows_of(request_id) if row.output_token_ids is not None
            for t in row.output_token_ids]


def locate(req: RequestTrace, position: int, trace: Trace | None = None) -> str:
    """Where an output position was produced, as the engine's own step records say ("produced at" the
    engine step, and the verify step or row kind); when the record shows another token there than the
    output, that; when the output ended before the position, that."""
    if position >= len(req.token_ids):
        return f"(the output ended after {len(req.token_ids)} tokens, finish {req.finish_reason!r})"
    recorded = recorded_tokens(trace, req.request_id) if trace is not None else None
    if recorded is not None and trace.steps and position >= len(recorded):
        return f"(no step record produced it: the records show {len(recorded)} output tokens)"
    if position >= len(req.token_steps):
        return "(no step records)"
    where = f"produced at engine step {req.token_steps[position]}"
    if recorded is not None and trace.steps and recorded[position][1] != req.token_ids[position]:
        return (f"{where} by its step record, which shows token {recorded[position][1]} there, not "
                f"{req.token_ids[position]}: the output disagrees with the engine's own record")
    v = _verify_index(req, position)
    if v is not None:
        return f"{where}, verify step {v}"
    kind = req.token_kinds[position] if position < len(req.token_kinds) else "decode"
    return f"{where}, sampled by a prefill" if kind == "prefill" else f"{where}, a decode step"


def _labels(a: Trace, b: Trace) -> tuple[str, str, int]:
    width = max(len(a.engine), len(b.engine))
    return a.engine.ljust(width), b.engine.ljust(width), width


def _missing(name: str, reference: Trace, test: Trace) -> CheckResult | None:
    lost = sorted(set(reference.requests) - set(test.requests))
    if lost:
        return failed(name, f"{len(lost)} request(s) never finished in {test.engine}: {', '.join(lost[:8])}",
                      request_id=lost[0], missing=lost)
    return None


def check_tokens(
    reference: Trace,
    test: Trace,
    name: str = "tokens",
    skip: set[str] | frozenset = frozenset(),
) -> CheckResult:
    """Every request's output tokens and finish reason are identical.

    Requests in ``skip`` (the ones the workload aborts) are left out: how much of an aborted request
    ran depends on when the abort reached each engine, so the "aborts" check judges them instead.
    """
    if (missing := _missing(name, reference, test)) is not None:
        return missing
    diverged = []
    for rid in sorted(reference.requests):
        if rid in skip:
            continue
        ref, got = reference.requests[rid], test.requests[rid]
        pos = first_difference(ref.token_ids, got.token_ids)
        if pos is None and ref.finish_reason != got.finish_reason:
            pos = len(ref.token_ids)
        if pos is not None:
            step = got.token_steps[pos] if pos < len(got.token_steps) else 1 << 30
            diverged.append((step, rid, pos))
    if not diverged:
        compared = [r for rid, r in reference.requests.items() if rid not in skip]
        total = sum(len(r.token_ids) for r in compared)
        left_out = len(reference.requests) - len(compared)
        return passed(name, f"{len(compared)} requests, {total} tokens identical"
                      + (f" ({left_out} aborted, judged by 'aborts')" if left_out else ""))
    _, rid, pos = min(diverged)
    ref, got = reference.requests[rid], test.requests[rid]
    la, lb, _ = _labels(reference, test)
    v_ref = _verify_index(ref, pos)
    v_got = _verify_index(got, pos)
    lines = [
        f"request {rid} ({len(ref.prompt_token_ids)}-token prompt) diverges at output position {pos}",
        f"  {la} : {token_window(ref.token_ids, pos)}   {locate(ref, pos, reference)}",
        f"  {lb} : {token_window(got.token_ids, pos)}   {locate(got, pos, test)}",
        f"  finish reason: {reference.engine} {ref.finish_reason!r}, {test.engine} {got.finish_reason!r}",
        "  acceptance per verify step (drafted/accepted):",
        f"    {la} : {acceptance_history(ref.acceptance, v_ref)}",
        f"    {lb} : {acceptance_history(got.acceptance, v_got)}",
    ]
    if len(diverged) > 1:
        others = ", ".join(r for _, r, _ in sorted(diverged)[1:9])
        lines.append(
            f"  {len(diverged)} of {len(reference.requests) - len(skip & reference.requests.keys())} "
            f"requests diverge; the others: {others}"
        )
    summary = f"request {rid}: first divergence at output position {pos}" + (
        f" (verify step {v_got})" if v_got is not None else "")
    return failed(name, summary, "\n".join(lines), rid, position=pos, verify_step=v_got,
                  step=got.token_steps[pos] if pos < len(got.token_steps) else None,
                  reference_window=ref.token_ids[max(0, pos - WINDOW): pos + WINDOW + 1],
                  test_window=got.token_ids[max(0, pos - WINDOW): pos + WINDOW + 1],
                  diverging_requests=[r for _, r, _ in sorted(diverged)])


@check(
    "tokens",
    reads=("ref", "test"),
    passes_when=(
        "every request's output tokens and finish reason are identical (aborted requests: see `aborts`); "
        "where a token was produced is read from the engine's step records"
    ),
)
def _tokens(c: CheckInputs) -> CheckResult:
    return check_tokens(c.ref, c.test, skip=c.aborted)


def _verify_index(req: RequestTrace, position: int) -> int | None:
    for v in req.verify_steps:
        if v.position is not None and v.position <= position < v.position + v.accepted + 1:
            return v.index
    return None


def _verifies_by_position(trace: Trace, rid: str) -> dict[int, tuple[tuple[int, ...], int]]:
    """A request's verify steps keyed by the position of their first token: (drafts, accepted)."""
    return {r.num_computed_tokens: (tuple(r.draft_token_ids), r.num_accepted)
            for r in trace.rows_of(rid) if r.kind == "decode" and r.num_accepted is not None}


def check_acceptance(
    reference: Trace, test: Trace, aborted: set[str] | frozenset = frozenset()
) -> CheckResult:
    """Per request, per verify step: the same drafts, the same number drafted and accepted.

    Requests neither engine preempted must have identical histories, step for step. A preemption
    replaces a verify step by a re-prefill, and the engines may preempt at different points, so
    for preempted requests the verify steps are matched by position: wherever both engines verified
    at the same position, the drafts and the accepted count must agree. Aborted requests (``aborted``)
    are matched by position too: each engine's history ends wherever the abort reached it.
    """
    name = "acceptance"
    if (missing := _missing(name, reference, test)) is not None:
        return missing
    steps = sum(len(r.acceptance) for r in reference.requests.values())
    if steps == 0:
        return not_applicable(name, "no verify steps ran (K=0)")
    la, lb, _ = _labels(reference, test)
    matched = 0
    for rid in sorted(reference.requests):
        ref_req, got_req = reference.requests[rid], test.requests[rid]
        ref_pos, got_pos = _verifies_by_position(reference, rid), _verifies_by_position(test, rid)
        for pos in sorted(ref_pos.keys() & got_pos.keys()):
            matched += 1
            if ref_pos[pos] != got_pos[pos]:
                (rd, ra), (gd, ga) = ref_pos[pos], got_pos[pos]
                lines = [f"request {rid}, verify step at position {pos}:",
                         f"  {la} : drafts {list(rd)}, accepted {ra}",
                         f"  {lb} : drafts {list(gd)}, accepted {ga}",
                         "  the same point of the request was drafted or verified differently"]
                if rd != gd:
                    summary = f"request {rid}: at position {pos} drafted {list(gd)}, expected {list(rd)}"
                else:
                    summary = f"request {rid}: at position {pos} accepted {ga} of {len(gd)}, expected {ra}"
                return failed(name, summary, "\n".join(lines), rid, position=pos,
                              reference=[len(rd), ra], test=[len(gd), ga])
        if ref_req.num_preemptions or got_req.num_preemptions or rid in aborted:
            continue
        ref, got = ref_req.acceptance, got_req.acceptance
        v = first_difference(ref, got)
        if v is None:
            continue
        r_step = ref[v] if v < len(ref) else None
        g_step = got[v] if v < len(got) else None
        vs = ref_req.verify_steps
        where = f" (output position {vs[v].position})" if v < len(vs) and vs[v].position is not None else ""
        lines = [
            (f"request {rid}, verify step {v}{where}: {reference.engine} drafted/accepted "
             f"{_fmt(r_step)}, {test.engine} {_fmt(g_step)}"),
            f"  {la} : {acceptance_history(ref, v)}",
            f"  {lb} : {acceptance_history(got, v)}",
        ]
        return failed(name, f"request {rid}: verify step {v} drafted/accepted {_fmt(g_step)}, expected "
                      f"{_fmt(r_step)}", "\n".join(lines), rid, verify_step=v,
                      reference=list(r_step) if r_step else None, test=list(g_step) if g_step else None)
    return passed(name, f"{steps} verify steps identical ({matched} matched by position)")


@check(
    "acceptance",
    reads=("ref", "test"),
    needs=("rows", "kind", "draft_token_ids", "output_token_ids", "num_accepted"),
    passes_when=(
        "(drafted, accepted) identical per request per verify step, a step that verified no drafts (n-gram "
        "lookup found none) included (preempted and aborted requests: where both verified the same "
        "position)"
    ),
)
def _acceptance(c: CheckInputs) -> CheckResult:
    return check_acceptance(c.ref, c.test, aborted=c.aborted)


def _fmt(step: tuple[int, int] | None) -> str:
    return "none (no such step)" if step is None else f"{step[0]}/{step[1]}"


def check_logits_digests(reference: Trace, test: Trace) -> CheckResult:
    """Bitwise-equal verify logits wherever both engines recorded a digest for the same rows."""
    name = "logits-digests"
    compared = 0
    for rid in sorted(set(reference.requests) & set(test.requests)):
        ref = {(p, n): d for p, n, d in reference.requests[rid].logits}
        got = {(p, n): d for p, n, d in test.requests[rid].logits}
        for key in sorted(ref.keys() & got.keys()):
            compared += 1
            if ref[key] != got[key]:
                pos, rows = key
                what = f"output position {pos} ({rows} logit row{'s' if rows > 1 else ''})"
                return failed(
                    name,
                    f"request {rid}: logits at {what} differ bitwise",
                    f"request {rid}: the verify logits for {what} hash to {ref[key]} in "
                    f"{reference.engine} and {got[key]} in {test.engine}\n"
                    "  where the tokens still agree, bitwise-different logits mean some kernel's result "
                    "depends on the batch or its padding",
                    rid,
                    position=pos,
                    rows=rows,
                )
    if compared == 0:
        return not_applicable(name, "no logits digests recorded by both engines")
    return passed(name, f"{compared} logits digests identical")


@check(
    "logits-digests",
    reads=("ref", "test"),
    needs=("rows", "logits_digest"),
    passes_when="verify logits bitwise equal wherever both recorded a digest (batch-invariant engines)",
)
def _logits_digests(c: CheckInputs) -> CheckResult:
    if not c.batch_invariant:
        return not_applicable("logits-digests", "the engine under test is not batch-invariant")
    return check_logits_digests(c.ref, c.test)


def check_spec_lossless(
    plain: Trace | None,
    test: Trace,
    skip: set[str] | frozenset = frozenset(),
    test_plain: Trace | None = None,
) -> CheckResult:
    """Speculative output equals plain greedy output (the same workload run with K=0).

    Aborted requests (``skip``) are left to the "aborts" check, which holds them to the same plain run.
    ``test_plain``: the engine under test itself on the plain workload (K=0), run only when this check
    fails: speculation is blamed only when that run agrees with plain greedy output.
    """
    if plain is None:
        return not_applicable("spec-lossless", "K=0: no speculation to compare")
    result = check_tokens(plain, test, name="spec-lossless", skip=skip)
    if result.failed:
        result.report = _spec_blame(plain, test_plain, skip) + "\n" + result.report
    return result


@check(
    "spec-lossless",
    reads=("plain", "test", "test_plain"),
    passes_when=(
        "output equals plain greedy output (same workload, K=0, reference engine); when it does not, the "
        "engine under test is run once more with K=0, and speculation is blamed only if that run agrees "
        "with plain greedy output (else the report says the bug is not in speculative decoding); "
        "sampling requests are equal in distribution only (the nightly `spec-distribution` check)"
    ),
)
def _spec_lossless(c: CheckInputs) -> CheckResult:
    plain = c.plain if c.scenario.k else None
    sampled = {r.request_id for r in c.scenario.requests if r.samples}
    if plain is not None and sampled and len(sampled) == len(c.scenario.requests):
        return not_applicable("spec-lossless", "every request samples: equal to plain output in distribution "
                              "only (the nightly spec-distribution check)")
    return check_spec_lossless(plain, c.test, skip=c.aborted | sampled, test_plain=c.test_plain)


def _spec_blame(plain: Trace, test_plain: Trace | None, skip) -> str:
    """Whether the difference is speculation's: what the engine under test does with speculation off."""
    head = "the engine under test's output differs from plain greedy decoding (K=0, reference engine)"
    if test_plain is None:
        return head + "; whether speculation is the cause is not known (no K=0 run of the engine under test)"
    if test_plain.error is not None:
        return head + "; the engine under test failed the same workload with speculation off (K=0) too"
    alone = check_tokens(plain, test_plain, name="spec-lossless", skip=skip)
    if alone.failed:
        return (head + "; with speculation off (K=0) the engine under test differs as well "
                f"({alone.summary}): the bug is not in speculative decoding")
    return ("speculative decoding changed the output: with speculation off (K=0) the engine under test "
            "matches plain greedy decoding, with drafts it differs")


def check_request_outputs(reference: Trace, test: Trace, k: int,
                          skip_prompts: set[str] | frozenset = frozenset()) -> CheckResult:
    """The public ``RequestOutput`` fields that no other check compares, and the counters' meaning.

    Every public field is compared exactly once across the checks, so one bug fails one check:
    ``token_ids`` and ``finish_reason`` by "tokens"; ``acceptance`` by "acceptance"; ``num_cached_tokens``
    by "cached-tokens" (against its ceiling: the oracle runs without a cache); the rest here:

    - per engine, for every request: ``num_draft_tokens`` and ``num_accepted_tokens`` are the sums of
      its ``acceptance`` history, and every verify step drafted at most K tokens and accepted at most
      what it drafted. With the "acceptance" check (identical histories for requests neither engine
      preempted or aborted), the counters are then equal across the engines wherever they must be;
    - across the engines: ``prompt_token_ids`` are equal, and so is ``text`` wherever both engines
      report one and the tokens agree (differing tokens are the "tokens" check's failure), and ``seed``
      (the sampling seed a request reports: its own, or the one drawn at its admission) wherever both
      report one, so a run can be replayed from what it reported.

    Not compared across engines: ``num_preemptions`` (an engine that schedules a step ahead uses the
    KV pool differently and may preempt other requests, or at other points), nor the counters of
    preempted or aborted requests (a preemption replaces verify steps by a re-prefill; an abort ends
    each engine's history wherever it reached that engine); those stay held to the per-engine rules.
    ``skip_prompts``: requests whose prompts are not compared (a next turn whose earlier turn's output
    may differ, under ``--verdict rescored``).
    """
    name = "request-outputs"
    if (missing := _missing(name, reference, test)) is not None:
        return missing
    for trace in (reference, test):
        for rid in sorted(trace.requests):
            problem = _counter_problem(trace.requests[rid], k)
            if problem:
                req = trace.requests[rid]
                return failed(
                    name,
                    f"request {rid}: {trace.engine} reports {problem}",
                    f"request {rid} in {trace.engine}: {problem}\n"
                    f"  num_draft_tokens={req.num_draft_tokens}, num_accepted_tokens="
                    f"{req.num_accepted_tokens}\n  acceptance: {acceptance_history(req.acceptance)}",
                    rid,
                    engine=trace.engine,
                    field="counters",
                )
    texts = 0
    for rid in sorted(reference.requests):
        ref, got = reference.requests[rid], test.requests[rid]
        fields = [] if rid in skip_prompts else ["prompt_token_ids"]
        if ref.seed is not None and got.seed is not None:
            fields.append("seed")
        if ref.text is not None and got.text is not None and ref.token_ids == got.token_ids:
            fields.append("text")
            texts += 1
        for f in fields:
            a, b = getattr(ref, f), getattr(got, f)
            if a != b and not (f == "text" and _held_back(a, b)):
                la, lb, _ = _labels(reference, test)
                return failed(name, f"request {rid}: {f} is {_short(b)} in {test.engine}, {_short(a)} in "
                              f"{reference.engine}",
                              f"request {rid}: the public field {f} differs\n  {la} : {_short(a, 200)}\n"
                              f"  {lb} : {_short(b, 200)}", rid, field=f)
    counted = sum(r.num_draft_tokens is not None for t in (reference, test) for r in t.requests.values())
    return passed(name, f"{len(reference.requests)} requests: prompts{' and texts' if texts else ''} agree, "
                  f"{counted} outputs' draft counters match their acceptance histories")


@check(
    "request-outputs",
    reads=("ref", "test"),
    passes_when=(
        "the other public `RequestOutput` fields: per engine `num_draft_tokens` / `num_accepted_tokens` are "
        "the sums of its `acceptance` (each step 0 <= accepted <= drafted <= K); `prompt_token_ids` equal, "
        "`text` equal where the tokens are (an engine may hold back the bytes of an incomplete trailing "
        "UTF-8 sequence, as vLLM does, where the reference shows U+FFFD), the reported sampling `seed` "
        "equal; `num_preemptions` not "
        "compared (an async engine may preempt elsewhere), `num_cached_tokens` is `cached-tokens`'"
    ),
)
def _request_outputs(c: CheckInputs) -> CheckResult:
    return check_request_outputs(c.ref, c.test, c.scenario.k)


def _counter_problem(req: RequestTrace, k: int) -> str | None:
    drafted = sum(d for d, _ in req.acceptance)
    accepted = sum(a for _, a in req.acceptance)
    if req.num_draft_tokens is not None and req.num_draft_tokens != drafted:
        return f"num_draft_tokens={req.num_draft_tokens}, but its acceptance history drafted {drafted}"
    if req.num_accepted_tokens is not None and req.num_accepted_tokens != accepted:
        return (
            f"num_accepted_tokens={req.num_accepted_tokens}, but its acceptance history accepted {accepted}"
        )
    for i, (d, a) in enumerate(req.acceptance):
        if not 0 <= a <= d <= k:
            return (
                f"verify step {i} drafted {d} and accepted {a} "
                f"(each must be within 0 <= accepted <= drafted <= K={k})"
            )
    return None


def _held_back(ref_text: str, test_text: str) -> bool:
    """Whether ``test_text`` is ``ref_text`` without the U+FFFD the reference shows for an incomplete
    trailing UTF-8 sequence (at most 3 bytes: vLLM's detokenizer keeps them back until a later token)."""
    tail = ref_text[len(test_text):]
    return ref_text.startswith(test_text) and 0 < len(tail) <= 3 and set(tail) == {"\ufffd"}


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
