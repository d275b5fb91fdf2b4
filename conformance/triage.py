"""``conformance triage``: is a divergence a bug or numerics?

Given an engine, a checkpoint and prompts (or a scenario file), it runs the engine and the reference, has the
reference score the engine's output (``conformance.scoring``), and prints the first divergence: both tokens,
their margins (nats below the reference's pick) and logprobs under the reference, and the calibrated
tolerance. Then it reruns the controls, each scored the same way:

- speculation off (K=0), when the workload speculates;
- a batch of one: the diverging request alone;
- prefix caching off, when the workload caches;
- the reference in the engine's dtype scoring the same output (what the dtype alone explains).

One verdict line follows (``near-tie: within bfloat16 noise``, ``structural: the drafter path``, ...), and
a scenario file (conformance/workloads/files.py's format) that replays the workload, with the replay
command. Where the engine reports its verify steps, the diverging request's acceptance is printed next to
the reference's on the same drafts (how many of each step's drafts the reference's picks take, given the
engine's tokens before them).

Exit status: 0 no structural divergence, 1 a structural one, 2 usage errors.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace

from conformance.checks.compare import token_window
from conformance.scoring import RequestScore, Scorer, score_trace
from conformance.workloads import EngineSettings, RequestSpec, Scenario, file_scenario
from conformance.workloads.files import write_scenario_file


@dataclass
class Judged:
    """One run of the engine, scored: its trace and its scores by request."""

    label: str
    trace: object
    scores: dict[str, RequestScore]

    def structural(self, rid: str, tolerance: float) -> bool:
        s = self.scores.get(rid)
        return s is not None and any(m > tolerance for m in s.margins)

    def worst(self, rid: str) -> float:
        s = self.scores.get(rid)
        return max(s.margins, default=0.0) if s is not None else 0.0


def workload(args, vocab_size: int, tier: str) -> Scenario:
    """The triaged workload: the scenario file's, or the prompts (text or ids) arriving together."""
    if args.scenario_file:
        if args.prompt or args.prompt_ids:
            raise ValueError("give prompts or a --scenario-file, not both")
        return file_scenario(args.scenario_file, vocab_size, tier)
    prompts: list = list(args.prompt)
    for text in args.prompt_ids:
        try:
            ids = tuple(int(t) for t in text.split(",") if t.strip())
        except ValueError:
            raise ValueError(f"--prompt-ids {text!r}: comma-separated token ids, e.g. 1,2,3") from None
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if not ids or bad:
            raise ValueError(f"--prompt-ids {text!r}: ids in [0, {vocab_size}) needed"
                             + (f", got {bad[0]}" if bad else ""))
        prompts.append(ids)
    if not prompts:
        raise ValueError("give --prompt TEXT, --prompt-ids 1,2,3 or --scenario-file FILE")
    settings = EngineSettings(num_speculative_tokens=args.num_speculative_tokens,
                              drafter=args.spec_drafter if args.num_speculative_tokens else "mtp")
    requests = tuple(RequestSpec(f"r{i:02d}", p, args.max_tokens) for i, p in enumerate(prompts))
    return Scenario("triage", f"{len(requests)} prompt(s) given to conformance triage", tier, settings,
                    requests)


def run_triage(args, sel, out) -> int:
    from conformance.adapters.refengine import reference_adapter
    from conformance.harness import REFERENCE_LABEL, run_workload, skip_reason

    if sel.verdict == "exact":  # triage judges by rescoring: the float32 reference unless told otherwise
        sel = replace(sel, verdict="rescored", reference_dtype=sel.reference_dtype or "float32")
    case = sel.open_case()
    verdict = case.judged
    scenario = case.apply(workload(args, case.facts.vocab_size, sel.tier))
    why = skip_reason(scenario, case)
    if why:
        raise ValueError(f"the engine under test cannot run this workload: {why}")
    ref_device = case.reference_device or case.device
    say = _printer(out)
    say(f"conformance triage: engine under test {case.engine} in {case.dtype} on {case.device}, model "
        f"{case.facts.label}; the reference engine in {verdict.reference_dtype} on {ref_device} scores its "
        f"output; tolerance {verdict.tolerance:.4g} nats ({verdict.source})")
    say(f"workload {scenario.id}: {len(scenario.requests)} request(s), {scenario.settings.describe()}")
    scorer = Scorer(case.facts.path, verdict.reference_dtype, ref_device)

    def judged(label: str, sc: Scenario) -> Judged:
        trace = run_workload(case.adapter_for(sc), sc, case.facts, label=label, device=case.device,
                             dtype=case.dtype, step_timeout=case.step_timeout)
        if trace.error is not None:
            raise RuntimeError(f"{label} did not finish the workload:\n{trace.error}")
        return Judged(label, trace, score_trace(scorer, trace, sc))

    main = judged(case.engine, scenario)
    reference = run_workload(reference_adapter(), scenario, case.facts, label=REFERENCE_LABEL,
                             **case.reference_where)
    rid = _focus(main, verdict.tolerance)
    if rid is None:
        say("no divergence: at every position of every request the engine's token is the reference's pick")
        return _finish(args, case, scenario, say, "agrees: no divergence from the reference", None)
    _divergence(say, main, reference, rid, verdict, case.dtype)
    _acceptance(say, main, rid)
    say("controls (each rerun of the engine scored the same way):")
    controls = _controls(scenario, rid, judged, main, case, say)
    line = _verdict_line(main, rid, verdict, controls, case.dtype)
    return _finish(args, case, scenario, say, line, _origin(main, rid, verdict))


def _printer(out):
    def say(text: str = "") -> None:
        print(text, file=out, flush=True)

    return say


def _focus(main: Judged, tolerance: float) -> str | None:
    """The request to look at: the first with a structural divergence, else the one with the worst margin."""
    diverging = [rid for rid, s in sorted(main.scores.items()) if s.divergences()]
    if not diverging:
        return None
    structural = [rid for rid in diverging if main.structural(rid, tolerance)]
    return structural[0] if structural else max(diverging, key=main.worst)


def _fmt(m: float) -> str:
    return "inf (its parameters forbid it)" if m == float("inf") else f"{m:.4g}"


def _divergence(say, main: Judged, reference, rid: str, verdict, dtype: str) -> None:
    s = main.scores[rid]
    i = s.divergences()[0]
    req = main.trace.requests[rid]
    ref_req = reference.requests.get(rid)
    say(f"request {rid} ({len(req.prompt_token_ids)}-token prompt, {len(s.tokens)} output tokens): first "
        f"divergence at output position {i}")
    say(f"  engine    : {token_window(s.tokens, i)}   token {s.tokens[i]}: {_fmt(s.margins[i])} nats below "
        f"the reference's pick (its logprob {s.logprobs[i]:.4g})")
    pick_lp = s.logprobs[i] + s.margins[i] if s.margins[i] != float("inf") else float("nan")
    say(f"  reference : its pick after the engine's tokens {s.tokens[max(0, i - 4):i]}: token {s.argmax[i]} "
        f"(margin 0, logprob {pick_lp:.4g})")
    if ref_req is not None:
        say(f"  reference's own run: {token_window(ref_req.token_ids, i)}")
    say(f"  tolerance : {verdict.tolerance:.4g} nats ({dtype} against the reference in "
        f"{verdict.reference_dtype})")
    divs = s.divergences()
    worst = s.worst()
    kinds = [verdict.classify(s.margins[j]) for j in divs]
    say(f"  {len(divs)} divergence(s) in this request, {kinds.count('structural')} structural; the worst at "
        f"position {worst}: {_fmt(s.margins[worst])} nats ({verdict.classify(s.margins[worst])})")


def reference_acceptance(score: RequestScore, trace, rid: str) -> list[tuple[int, int, str]]:
    """Per verify step of ``rid``: (drafted, engine accepted, reference accepted on the same drafts); the
    reference's count is how many leading drafts its picks take given the engine's tokens before them
    (">=n" where the engine's output stops showing what the reference would do further)."""
    rows = [r for r in trace.rows_of(rid) if r.kind == "decode" and r.num_accepted is not None
            and r.output_token_ids is not None]
    out, produced = [], 0
    first = [r for r in trace.rows_of(rid) if r.output_token_ids is not None]
    offsets = {}
    for r in first:  # the output position of each row's first token
        offsets[id(r)] = produced
        produced += len(r.output_token_ids)
    for r in rows:
        q, drafts, a = offsets[id(r)], r.draft_token_ids, r.num_accepted
        took = 0
        for j, d in enumerate(drafts):
            pos = q + j
            if j > a or pos >= len(score.argmax):
                took = None
                break
            if score.argmax[pos] != d:
                break
            took += 1
        shown = f">={a + 1}" if took is None else str(took)
        out.append((len(drafts), a, shown))
    return out


def _acceptance(say, main: Judged, rid: str) -> None:
    s = main.scores[rid]
    steps = reference_acceptance(s, main.trace, rid) if main.trace.steps else []
    if not steps:
        return
    shown = " ".join(f"{d}/{a}/{r}" for d, a, r in steps[:24]) + (" ..." if len(steps) > 24 else "")
    say("  acceptance per verify step (drafted/engine accepted/reference accepted on the same drafts): "
        + shown)


def _controls(scenario: Scenario, rid: str, judged, main: Judged, case, say) -> dict[str, bool | None]:
    """Rerun the controls; per control: whether the request still diverges structurally (None: n/a)."""
    tol = case.judged.tolerance
    results: dict[str, bool | None] = {}

    def report(name: str, run: Judged | None, why: str = "") -> None:
        if run is None:
            results[name] = None
            say(f"  {name:<30}: n/a ({why})")
            return
        s = run.scores.get(rid)
        if s is None or not s.margins:
            results[name] = None
            say(f"  {name:<30}: n/a (the request produced nothing)")
            return
        bad = run.structural(rid, tol)
        results[name] = bad
        divs = s.divergences()
        say(f"  {name:<30}: " + (f"{len(divs)} divergence(s), the first at {divs[0]}, worst "
                                 f"{_fmt(run.worst(rid))} nats: {'structural' if bad else 'near-tie'}"
                                 if divs else "no divergence (every token the reference's pick)"))

    s = scenario.settings
    if s.k:
        off = replace(s.plain(), enable_prefix_caching=s.enable_prefix_caching,
                      mamba_cache_mode=s.mamba_cache_mode)
        report("speculation off (K=0)", judged("speculation off", replace(scenario, settings=off)))
    else:
        report("speculation off (K=0)", None, "the workload does not speculate")
    alone = _alone(scenario, rid)
    if len(alone.requests) < len(scenario.requests):
        report(f"batch of one ({rid} alone)", judged("batch of one", alone))
    else:
        report(f"batch of one ({rid} alone)", None, "it is the only request")
    if s.enable_prefix_caching:
        report("prefix cache off", judged("prefix cache off", replace(scenario, settings=s.uncached())))
    else:
        report("prefix cache off", None, "the workload does not cache")
    if case.judged.reference_dtype != case.dtype:
        own = Scorer(case.facts.path, case.dtype, case.reference_device or case.device)
        report(f"the reference in {case.dtype}", Judged("own dtype", main.trace,
                                                         score_trace(own, main.trace, scenario)))
    else:
        report(f"the reference in {case.dtype}", None, "it already is")
    return results


def _alone(scenario: Scenario, rid: str) -> Scenario:
    """The request alone (with the turns it extends), arriving at step 0."""
    by_id = {r.request_id: r for r in scenario.requests}
    keep, cur = [], by_id[rid]
    while cur is not None:
        keep.append(cur)
        cur = by_id.get(cur.extends) if cur.extends else None
    kept = {r.request_id for r in keep}
    first = min(r.arrival_step for r in keep)
    requests = tuple(replace(r, arrival_step=r.arrival_step - first) for r in scenario.requests
                     if r.request_id in kept)
    return replace(scenario, requests=requests)


def _verdict_line(main: Judged, rid: str, verdict, controls: dict, dtype: str) -> str:
    worst = main.worst(rid)
    if not main.structural(rid, verdict.tolerance):
        return (f"near-tie: within {dtype} noise (worst margin {worst:.4g} <= tolerance "
                f"{verdict.tolerance:.4g} nats)")
    blame = {"speculation off (K=0)": ("the drafter path", "speculation off"),
             "prefix cache off": ("the prefix cache", "prefix caching off"),
             f"batch of one ({rid} alone)": ("batching", "the request alone")}
    clean = [name for name in blame if controls.get(name) is False]  # in the order of blame
    own = controls.get(f"the reference in {dtype}")
    if clean:
        return (f"structural: {blame[clean[0]][0]} (within tolerance with "
                + " and with ".join(blame[c][1] for c in clean) + ")")
    if own is False:
        return (f"numerics: the reference in {dtype} picks the engine's tokens (the {dtype} error exceeds "
                f"the calibrated tolerance here: worst {worst:.4g} nats)")
    return (f"structural: the engine itself ({_fmt(worst)} nats below the reference's pick, and every "
            "control diverges too)")


def _origin(main: Judged, rid: str, verdict) -> dict:
    s = main.scores[rid]
    i = s.divergences()[0]
    return {"triage": {"request": rid, "position": i, "token": s.tokens[i], "reference_pick": s.argmax[i],
                       "margin": None if s.margins[i] == float("inf") else s.margins[i],
                       "tolerance": verdict.tolerance, "reference_dtype": verdict.reference_dtype}}


def _finish(args, case, scenario: Scenario, say, line: str, origin: dict | None) -> int:
    say(f"verdict: {line}")
    path = write_scenario_file(args.out, replace(scenario, id="triage"), case.facts.vocab_size,
                               {**(origin or {}), "verdict": line})
    cmd = ["conformance", "run", "--scenario-file", str(path), "--engine", case.engine]
    if case.model_arg is not None:
        cmd += ["--model", case.model_arg if case.model_arg.startswith("tiny:") else case.facts.path]
    cmd += ["--dtype", case.dtype, "--verdict", "rescored", "--reference-dtype", case.judged.reference_dtype]
    if case.device != "cpu":
        cmd += ["--device", case.device]
    if case.reference_device is not None:
        cmd += ["--reference-device", case.reference_device]
    if case.tolerance is not None:
        cmd += ["--tolerance", repr(case.tolerance)]
    say(f"scenario file written: {path}\nreplay: {shlex.join(cmd)}")
    return 1 if line.startswith("structural") else 0
