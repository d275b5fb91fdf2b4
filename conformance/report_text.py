"""Human-readable reports: one block per scenario, a legend, per-request replay detail."""

from __future__ import annotations

from conformance.checks import acceptance_history
from conformance.results import FAIL, NA, PASS, ScenarioResult
from conformance.trace import Trace

LEGEND = """\
How to read a failure:
  - "reference" is refengine's reference engine (synchronous, no graphs) on the same configuration;
    it defines the correct output. The other name is the engine under test.
  - output position: index into a request's generated tokens (0 = the first generated token).
  - verify step: the request's n-th speculative verification (K drafts checked by the target model).
  - drafted/accepted: drafts proposed and drafts the target model kept in that verify step.
  - in token windows, [brackets] mark the first token that differs; "..." means more tokens.
  - replay: a command that reruns just that scenario and prints the request step by step."""


VERDICTS = {"pass": "PASS", "fail": "FAIL", "xfail": "XFAIL", "skip": "SKIP", "error": "ERROR"}


def status_line(result: ScenarioResult, index: int | None = None, total: int | None = None,
                elapsed: float | None = None) -> str:
    """One line per scenario: the verdict once the expectations are applied (an expected failure is
    XFAIL, never FAIL; a stale entry under strict expectations is FAIL and says so), and the counts."""
    prefix = f"[{index:>{len(str(total))}}/{total}] " if index is not None and total is not None else ""
    if result.skipped:
        detail = result.skipped
    elif result.error:
        detail = result.error.strip().splitlines()[-1]
    else:
        detail = _check_counts(result) + _stale_note(result)
    if result.verdict == "rescored":
        detail += "; verdict rescored"
    tail = f"  {result.duration_s:.1f} s" + (f" (elapsed {elapsed:.0f} s)" if elapsed is not None else "")
    return f"{prefix}{VERDICTS[result.outcome]:<5} {result.scenario_id}  [{detail}]{tail}"


def _check_counts(result: ScenarioResult) -> str:
    unexpected = [c.check for c in result.unexpected_failures]
    expected = [c.check for c in result.failures if c.check in result.expected]
    counts = f"{sum(c.status == PASS for c in result.checks)} passed, {len(unexpected)} failed"
    if expected:
        counts += f", {len(expected)} failed as expected"
    counts += f", {sum(c.status == NA for c in result.checks)} n/a"
    if unexpected:
        counts += ": " + ", ".join(unexpected)
    if expected:
        counts += f"; expected: {', '.join(expected)}"
    return counts


def _stale_note(result: ScenarioResult) -> str:
    if not result.stale:
        return ""
    what = "fails the run (strict expectations)" if result.stale_fails else "a warning"
    return f"; stale expected failure {', '.join(result.stale)} passed: {what}"


def format_result(result: ScenarioResult, show_passing: bool = False) -> str:
    """The block printed for a scenario that failed (or for any scenario with ``show_passing``)."""
    head = {"pass": "PASSED", "xfail": "EXPECTED FAILURE", "skip": "SKIPPED"}.get(result.outcome, "FAILED")
    lines = [
        f"{head} scenario {result.scenario_id}: {result.description}",
        f"  engine under test : {result.engine}",
        "  compared against  : reference engine (refengine, no graphs), same configuration",
        f"  model             : {result.model}",
        f"  configuration     : {result.settings}  (tier {result.tier})",
        f"  dtype             : {result.dtype} (both engines)" if result.verdict != "rescored" else
        f"  dtype             : {result.dtype} (engine under test), {result.reference_dtype} (reference)",
        f"  verdict           : {result.judged_by}",
    ]
    if result.skipped:
        lines.append(f"  skipped: {result.skipped}")
    if result.error:
        lines.append("  infrastructure error (not a conformance verdict):")
        lines += ["    " + line for line in result.error.rstrip().splitlines()]
    for c in result.checks:
        if c.status == FAIL:
            tag = f"XFAIL, expected: {result.expected[c.check]}" if c.check in result.expected else "FAIL"
            lines.append(f"  [{tag}] {c.check}: {c.summary}")
            lines += ["      " + line for line in c.report.rstrip().splitlines()]
            if "replay" in c.details:
                lines.append(f"      replay: {c.details['replay']}")
        elif show_passing:
            lines.append(f"  [{c.status.upper()}] {c.check}: {c.summary}")
    if result.stale:
        lines.append("  " + _stale_note(result).removeprefix("; "))
    if not show_passing:
        ok = [c.check for c in result.checks if c.status == PASS]
        na = [f"{c.check} ({c.summary})" for c in result.checks if c.status == NA]
        if ok:
            lines.append("  passed: " + ", ".join(ok))
        if na:
            lines.append("  not applicable: " + "; ".join(na))
    lines.append(f"  replay the scenario: {result.replay}")
    return "\n".join(lines)


def format_check_table(checks: list) -> str:
    """One line per check: how many scenarios it passed, failed and did not apply to."""
    names = list(dict.fromkeys(c.check for c in checks))
    width = max([len("check"), *map(len, names)])
    lines = [f"  {'check':<{width}} {'pass':>5} {'fail':>5} {'n/a':>5}"]
    for name in names:
        of = [c.status for c in checks if c.check == name]
        lines.append(f"  {name:<{width}} {of.count(PASS):>5} {of.count(FAIL):>5} {of.count(NA):>5}")
    return "\n".join(lines)


def format_coverage(results: list[ScenarioResult]) -> list[str]:
    """What the run exercised and what it did not: the scenarios skipped, grouped by why; the features
    the scenarios need, by how many ran and how many were skipped; the checks that applied nowhere."""
    lines = []
    skipped = [r for r in results if r.skipped]
    if skipped:
        refused = sum(r.skip_fails for r in skipped)
        lines.append(f"skipped: {len(skipped)} of {len(results)} scenarios did not run, so nothing was "
                     "checked on them" + (f" ({refused} counted failed: this run does not allow their skip)"
                                          if refused else "") + ":")
        by_reason: dict[str, list[str]] = {}
        for r in skipped:
            by_reason.setdefault(r.skipped, []).append(r.scenario_id)
        for reason, ids in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"  {len(ids)} x {reason}: {', '.join(ids)}")
    features = sorted({f for r in results for f in r.features})
    if features:
        parts = []
        for f in features:
            ran = sum(f in r.features and not r.skipped for r in results)
            skip = sum(f in r.features and bool(r.skipped) for r in results)
            parts.append(f"{f} {ran} ran" + (f", {skip} skipped" if skip else "")
                         + ("" if ran else " (NOT EXERCISED)"))
        lines.append("features: " + "; ".join(parts))
    checks = [c for r in results for c in r.checks]
    names = list(dict.fromkeys(c.check for c in checks))
    idle = [n for n in names if all(c.status == NA for c in checks if c.check == n)]
    if checks:
        never = f"; never applied (n/a in every scenario that ran): {', '.join(idle)}" if idle else ""
        lines.append(f"checks exercised: {len(names) - len(idle)} of {len(names)}{never}")
    lines += format_gaps(results)
    return lines


def format_gaps(results: list[ScenarioResult]) -> list[str]:
    """The named gaps: each trigger or parameter a scenario that ran did not exercise on this checkpoint,
    with why it may not (a warning; ``--require-exercised`` fails them instead)."""
    gaps = [(r.scenario_id, g) for r in results if not r.skipped and not r.error for g in r.gaps]
    if not gaps:
        return []
    head = (f"not exercised: {len(gaps)} gap(s) in {len({sid for sid, _ in gaps})} scenario(s), which ran "
            "and passed their other checks without testing this (a warning; --require-exercised fails them):")
    lines = [head]
    lines += [f"  not exercised: {sid}: {g['what']}" + (f" ({g['why']})" if g["why"] else "")
              for sid, g in gaps]
    return lines


def format_summary(results: list[ScenarioResult], elapsed: float) -> str:
    """Counts by verdict (expectations applied), the per-check table, then every scenario that failed,
    failed as expected, or has a stale expected-failure entry."""
    checks = [c for r in results for c in r.checks]
    by = {outcome: [r for r in results if r.outcome == outcome] for outcome in VERDICTS}
    failed = by["fail"] + by["error"]
    refused = sum(bool(r.skipped) for r in by["fail"])  # skips the gate does not allow: counted failed
    refused_note = f" ({refused} of them skipped, which this run does not allow)" if refused else ""
    skipped_note = "" if refused and not by["skip"] else f", {len(by['skip'])} skipped"
    lines = [
        (
            f"{len(results)} scenarios in {elapsed:.1f} s"
            + _dtypes_note(results)
            + f": {len(by['pass'])} passed, {len(failed)} failed{refused_note}, "
            f"{len(by['xfail'])} expected failures{skipped_note}; "
            f"{len(checks)} checks: {sum(c.status == PASS for c in checks)} passed, "
            f"{sum(c.status == FAIL for c in checks)} failed, {sum(c.status == NA for c in checks)} n/a"
        )
    ]
    lines.append(format_check_table(checks))
    lines += format_coverage(results)
    for r in failed:
        what = [c.check for c in r.unexpected_failures] or (["infrastructure error"] if r.error else [])
        if r.skipped:
            what.append(f"skipped, which this run does not allow: {r.skipped}")
        if r.stale and r.stale_fails:
            what.append(f"stale expected failure {', '.join(r.stale)} (strict expectations)")
        lines.append(f"  FAILED {r.scenario_id}: {'; '.join(what)}")
    for r in by["xfail"]:
        lines.append(
            f"  expected failure {r.scenario_id}: " + ", ".join(f"{k} ({v})" for k, v in r.expected.items())
        )
    for r in results:
        if r.stale and not r.stale_fails:
            lines.append(
                f"  stale expected failure {', '.join(r.stale)}: passed; remove the entry (a warning; "
                "strict expectations fail the run on it)"
            )
    return "\n".join(lines)


def _dtypes_note(results: list[ScenarioResult]) -> str:
    """", both engines in bfloat16", or under --verdict rescored who ran in what and who judged."""
    exact = sorted({r.dtype for r in results if r.verdict != "rescored"})
    rescored = sorted({(r.dtype, r.reference_dtype, r.tolerance) for r in results if r.verdict == "rescored"})
    parts = [f"both engines in {', '.join(exact)}"] if exact else []
    parts += [f"engine in {d}, rescored by the reference in {ref} (tolerance {tol:.4g} nats)"
              for d, ref, tol in rescored]
    return "".join(f", {p}" for p in parts)


def distinct(traces: dict[str, Trace]) -> list[Trace]:
    """Each trace once (the engine under test's run is the cached run when it is the reference engine)."""
    return list({id(t): t for t in traces.values()}.values())


def format_request_detail(request_id: str, traces: dict[str, Trace]) -> str:
    """Everything the traces know about one request, engine by engine, step by step."""
    lines = []
    for trace in distinct(traces):
        req = trace.requests.get(request_id)
        lines.append(f"== {trace.engine} ==")
        if req is None:
            lines.append(
                f"  request {request_id} did not finish" + (" (engine error)" if trace.error else "")
            )
            continue
        lines += [
            f"  prompt ({len(req.prompt_token_ids)} tokens): {req.prompt_token_ids}",
            f"  output ({len(req.token_ids)} tokens, finish {req.finish_reason}): {req.token_ids}",
            f"  acceptance (drafted/accepted): {acceptance_history(req.acceptance, limit=10**6)}",
            f"  preemptions: {req.num_preemptions}"
            + ("" if req.num_cached_tokens is None else f", prompt tokens served from the prefix cache: "
               f"{req.num_cached_tokens}"),
        ]
        gw = max([len("graph"), *(len(st.graph_mode) for st in trace.steps)])
        lines.append(f"  step  kind     computed  query  slot(off)  {'graph':<{gw}}  drafts -> output")
        for step in trace.steps:
            for r in step.rows:
                if r.request_id != request_id:
                    continue
                slot = "zero" if r.state_slot_read is None else f"{r.state_slot_read}({r.state_offset})"
                out = "(partial prefill)" if r.output_token_ids is None else str(r.output_token_ids)
                lines.append(f"  {step.index:>4}  {r.kind:<8} {r.num_computed_tokens:>8}  {r.query_len:>5}  "
                             f"{slot:>9}  {step.graph_mode:<{gw}}  {r.draft_token_ids} -> {out}")
    return "\n".join(lines)


def format_step_table(traces: dict[str, Trace], max_steps: int | None = None) -> str:
    """Every engine's steps, one line per row: what ran in which step, and what the requests returned."""
    lines = []
    for trace in distinct(traces):
        lines.append(f"== {trace.engine} ==" + (" (engine error)" if trace.error else ""))
        width = max([len("request"), *(len(r.request_id) for st in trace.steps for r in st.rows)])
        gw = max([len("graph"), *(len(st.graph_mode) for st in trace.steps)])
        lines.append(f"  step  {'graph':<{gw}}  {'request':<{width}}  kind     computed  query  slot(off)  "
                     "drafts -> output")
        steps = trace.steps if max_steps is None else trace.steps[:max_steps]
        for step in steps:
            mark = f"  preempted {', '.join(step.preempted)}" if step.preempted else ""
            if not step.rows:
                lines.append(f"  {step.index:>4}  {step.graph_mode:<{gw}}  (no rows){mark}")
            for i, r in enumerate(step.rows):
                slot = "zero" if r.state_slot_read is None else f"{r.state_slot_read}({r.state_offset})"
                out = "(partial prefill)" if r.output_token_ids is None else str(r.output_token_ids)
                head = f"  {step.index:>4}  {step.graph_mode:<{gw}}" if i == 0 else " " * (8 + gw)
                lines.append(
                    f"{head}  {r.request_id:<{width}}  {r.kind:<8} {r.num_computed_tokens:>8}  "
                    f"{r.query_len:>5}  {slot:>9}  {r.draft_token_ids} -> {out}" + (mark if i == 0 else "")
                )
        if max_steps is not None and len(trace.steps) > max_steps:
            lines.append(f"  ... {len(trace.steps) - max_steps} more steps")
        for rid, abort in sorted(trace.aborts.items()):
            lines.append(
                f"  aborted {rid} before engine step {abort.step} (after {abort.records_before} step records)"
                + ("" if abort.returned else "; it had already finished")
            )
        for rid, req in sorted(trace.requests.items()):
            lines.append(f"  {rid}: {len(req.token_ids)} tokens, finish {req.finish_reason}, acceptance "
                         f"{acceptance_history(req.acceptance)}, preemptions {req.num_preemptions}"
                         + (f", cached {req.num_cached_tokens}" if req.num_cached_tokens else ""))
    return "\n".join(lines)
