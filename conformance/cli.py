"""``conformance``: run the conformance suite against an engine from the command line.

  conformance list [--tier T]                   scenario ids, one line each
  conformance run [--engine E] [--tier T] [--scenario ID ...] [--scenario-file F ...] [--model PATH]
                  [--dtype D] [--report-json F] [--junit-xml F] [--xfail-file F] [--strict-expectations]
                  [--enable-prefix-caching [--mamba-cache-mode align|all]] [--step-timeout S]
                  [--fail-on-skip] [--min-scenarios N] [--require-feature F ...]
                  [--allow-unexercised | --require-exercised] [-x]
  conformance replay (ID | --scenario-file F) [--request R] [--engine E] [--model PATH] [--dtype D]
  conformance fuzz [--engine E] [--seed N] [--examples N] [--budget-seconds S] [--out DIR] [--dtype D]
  conformance mutate [--mutant ID ...] [--dtype D]

--dtype (float32, bfloat16, float16, or auto: the checkpoint's own) is what both engines run in; they
run the same kernels, so they are compared exactly (tokens, acceptance, logits bitwise) in any dtype.
--enable-prefix-caching (run, replay, fuzz) turns prefix caching on for the engine under test in every
scenario, in --mamba-cache-mode or each scenario's own mode; the reference engine runs without it.

The gate of a CI run: --fail-on-skip (a skipped scenario fails), --require-feature F (the engine must
support F and no scenario needing it may skip), --min-scenarios N (at least N scenarios must run),
--require-exercised (a trigger or parameter the checkpoint decides that the run did not exercise fails,
instead of being a warning and a named gap of the summary: for the models the corpus is tuned to).
--step-timeout S: an engine call that has not returned after S seconds fails its scenario.

Exit status: 0 when every check passed (or failed as an expectations file lists), 1 when a check
failed, a run broke or the gate refused the run (fuzz: a generated workload failed a check), 2 for
usage errors (unknown engine, scenario, scenario file or model) and for a checkpoint or device that
cannot be used, 130 when interrupted (Ctrl-C).

``conformance run`` is the pytest suite (``pytest --pyargs conformance.suite``) run in-process:
the same expectations (the engine's packaged file unless --xfail-file names one; stale entries warn,
or fail with --strict-expectations), the same outcomes and the same JUnit ids (pytest's own writer).
"""

from __future__ import annotations

import argparse
import sys

from conformance import session
from conformance.adapters import BUILTIN_ENGINES, describe_engine
from conformance.api import REQUIRABLE_FEATURES, UnknownEngine, missing_features
from conformance.expectations import ExpectationError
from conformance.watchdog import DEFAULT_STEP_TIMEOUT
from conformance.workloads import TIERS, UnknownScenario, file_scenario, scenario_defs
from conformance.workloads.scenario import DRAFTERS, MAMBA_CACHE_MODES
from refengine.tools.errors import (
    OneLineParser,
    add_dtype_flag,
    finite_number,
    float_above,
    int_at_least,
    one_line_warnings,
    setting_message,
)

THREADS_HELP = ("torch intra-op threads on CPU (default 1: the workloads are many small steps, where more "
                "threads only contend)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default=None, help=f"engine under test: {', '.join(BUILTIN_ENGINES)} or "
                   f"'package.module:factory' (default: ${session.ENV_ENGINE} or {session.DEFAULT_ENGINE})")
    p.add_argument("--model", default=None, help="checkpoint folder (default: $CONFORMANCE_MODEL or the "
                   "embedded default model)")
    p.add_argument("--tier", default="default", choices=TIERS, help="workload sizes (default: default)")
    p.add_argument(
        "--device", default=None, help="device for both engines (default: $CONFORMANCE_DEVICE or cpu)"
    )
    p.add_argument("--threads", type=int_at_least(1), default=1, help=THREADS_HELP)
    p.add_argument("--step-timeout", type=float_above(0), default=DEFAULT_STEP_TIMEOUT, metavar="SECONDS",
                   help="a call into the engine under test (start, add_request, step, ...) that has not "
                   "returned after this long fails its scenario by name; the run goes on with the next "
                   f"(default {DEFAULT_STEP_TIMEOUT:g})")
    add_dtype_flag(p, "both engines", default=None, default_text=f"${session.ENV_DTYPE} or float32")
    p.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="run every scenario with prefix caching "
        "for the engine under test (the reference engine it is compared with runs without)",
    )
    p.add_argument(
        "--mamba-cache-mode",
        choices=MAMBA_CACHE_MODES,
        default=None,
        help="with "
        "--enable-prefix-caching: where recurrent states are checkpointed (default: each scenario's "
        "own mode, else align)",
    )
    _verdict_flags(p)
    p.add_argument("--drafter", choices=DRAFTERS, default=None,
                   help="run every speculating scenario with this drafter instead of its own (both engines; "
                   "a trigger tuned to the scenario's drafter that the run misses is then a warning)")
    p.add_argument("--tensor-parallel-size", type=int_at_least(1), default=1, metavar="N",
                   help="tensor-parallel ranks of the engine under test (vLLM's own TP, e.g. over its CPU "
                   "backend; refengine's engines run on one); the reference always runs on one")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="--drafter draft_model: the draft checkpoint (a folder, tiny:<family>, or "
                   "cut:<layers>: the run's model cut to those layers, as `refengine make-draft-model` "
                   "does); --drafter eagle|eagle3: the head's folder in vLLM's layout (default: a seeded "
                   "head the suite makes for the model, conformance.eagle_heads)")


def _verdict_flags(p: argparse.ArgumentParser) -> None:
    from conformance.verdict import VERDICTS

    p.add_argument("--verdict", choices=VERDICTS, default="exact",
                   help="how the engine's tokens are judged: exact (bitwise the reference's, the default), "
                   "rescored (the reference scores the engine's own output; a token within the calibrated "
                   "tolerance of the reference's pick is a near-tie, one beyond it structural), auto (exact "
                   "for an engine declaring 'bitwise' in the reference's dtype and device, else rescored)")
    p.add_argument("--reference-dtype", choices=("float32", "bfloat16", "float16", "auto"), default=None,
                   help="--verdict rescored: the reference's dtype (default: the run's --dtype)")
    p.add_argument("--reference-device", default=None,
                   help="--verdict rescored: the reference's device (default: the run's --device)")
    p.add_argument("--tolerance", type=finite_number, default=None, metavar="NATS",
                   help="--verdict rescored: this tolerance instead of the calibrated one "
                   "(conformance/calibration.json)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="conformance", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="list scenario ids with a one-line description")
    ls.add_argument("--tier", default=None, choices=TIERS, help="only this tier's scenarios (default: all)")
    run = sub.add_parser("run", help="run scenarios and check the engine under test")
    _common(run)
    run.add_argument("--scenario", action="append", default=[], metavar="ID", help="run only this scenario "
                     "(repeatable; default: the whole tier)")
    run.add_argument(
        "--scenario-file",
        action="append",
        default=[],
        metavar="FILE",
        help="run the workload in "
        "this scenario file, e.g. one written by `conformance fuzz` (repeatable; with no --scenario, "
        "only the files run)",
    )
    run.add_argument("--report-json", metavar="FILE", help="write every result as JSON")
    run.add_argument("--junit-xml", metavar="FILE", help="write a JUnit XML report")
    run.add_argument("--xfail-file", metavar="FILE", help="expected failures (TOML) that do not fail the run "
                     "(default: the engine's packaged file in conformance/expectations/, if it has one)")
    run.add_argument(
        "--strict-expectations",
        action="store_true",
        help="a listed expected failure that passes fails its scenario (default: a warning)",
    )
    run.add_argument("-x", "--exitfirst", action="store_true",
                     help="stop at the first scenario with a failing check (its other checks still report)")
    run.add_argument("-v", "--verbose", action="store_true", help="print every check, passing ones included")
    gate = run.add_argument_group("gate", "what else fails the run (a CI gate that skips is not green)")
    gate.add_argument("--fail-on-skip", action="store_true", help="a skipped scenario fails the run (as a "
                      "failure of that scenario, in the JUnit file too)")
    gate.add_argument("--min-scenarios", type=int_at_least(0), default=0, metavar="N",
                      help="fail the run when fewer than N scenarios ran (were not skipped)")
    gate.add_argument("--require-feature", action="append", default=[], choices=REQUIRABLE_FEATURES,
                      metavar="FEATURE", help="the engine under test must support FEATURE (checked before "
                      "any scenario runs) and no scenario needing it may be skipped (repeatable; one of "
                      f"{', '.join(REQUIRABLE_FEATURES)})")
    gate.add_argument("--allow-unexercised", action="store_true",
                      help="a trigger a scenario's reference run misses (the workload did not test what "
                      "it exists for on this model) is a warning, not a failure (default: it fails the "
                      "scenario)")
    gate.add_argument("--require-exercised", action="store_true",
                      help="every trigger and every parameter a scenario exists to exercise must be, also "
                      "where the checkpoint decides (default: such a miss is a warning and a named gap of "
                      "the summary, 'not exercised'); for the models the corpus is tuned to (the presets)")
    rp = sub.add_parser(
        "replay", help="rerun one scenario and print its steps (or one request's) step by step"
    )
    rp.add_argument("scenario", metavar="ID", nargs="?", default=None)
    rp.add_argument("--scenario-file", metavar="FILE", default=None, help="replay the workload in this file")
    rp.add_argument(
        "--request",
        default=None,
        help="request id to print step by step (default: every step of the scenario, all requests)",
    )
    _common(rp)
    fz = sub.add_parser(
        "fuzz", help="run generated workloads until a check fails, then shrink and write it out"
    )
    _common(fz)
    fz.add_argument(
        "--seed",
        type=int_at_least(0),
        default=0,
        help="generation seed: the same seed gives the same workloads",
    )
    fz.add_argument(
        "--examples", type=int_at_least(1), default=100, help="most workloads to generate (default 100)"
    )
    fz.add_argument(
        "--draw-family", action="store_true",
        help="the seed draws the model family too: the embedded default model or a tiny model of another "
        "registered family (tiny:nemotron_h); not with --model",
    )
    fz.add_argument(
        "--budget-seconds",
        type=float_above(0),
        default=None,
        help="stop generating after this long (then the number of workloads depends on the machine)",
    )
    fz.add_argument(
        "--shrink-seconds",
        type=float_above(0),
        default=300.0,
        help="time limit for shrinking a failure (default 300)",
    )
    fz.add_argument("--out", default=".", metavar="DIR", help="where the shrunk failing workload is written "
                    "(default: the current directory)")
    fz.add_argument("--max-requests", type=int_at_least(1), default=6, help="most requests per workload "
                    "(default 6)")
    fz.add_argument("--max-prompt", type=int_at_least(1), default=40, help="longest prompt without a "
                    "max_model_len (default 40)")
    fz.add_argument("--max-new-tokens", type=int_at_least(1), default=12, help="most max_tokens per request "
                    "(default 12)")
    fz.add_argument("--no-aborts", action="store_true", help="generate no aborts")
    fz.add_argument("--no-shrink", action="store_true", help="write the first failing workload as found")
    fz.add_argument("-q", "--quiet", action="store_true", help="no line per workload")
    mu = sub.add_parser("mutate", help="run the suite against every mutant and print the mutation score")
    mu.add_argument(
        "--mutant", action="append", default=[], metavar="ID", help="only this mutant (repeatable)"
    )
    mu.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    mu.add_argument("--tier", default="default", choices=TIERS)
    mu.add_argument("--threads", type=int_at_least(1), default=1, help=THREADS_HELP)
    add_dtype_flag(mu, "the reference and the mutated async engine", default=None,
                   default_text=f"${session.ENV_DTYPE} or float32")
    mu.add_argument("--list", action="store_true", help="list the mutants and what they break")
    _calibrate_parser(sub)
    _triage_parser(sub)
    return parser


def _calibrate_parser(sub) -> None:
    from conformance.calibrate import DEFAULT_MODELS, ENGINE_DTYPES, ENGINES

    cal = sub.add_parser("calibrate", help="measure the tolerances of --verdict rescored on this project's "
                         "own engines and write the calibration table")
    cal.add_argument("--families", default=",".join(DEFAULT_MODELS), metavar="MODELS",
                     help="comma-separated models, one per family: 'default' (the embedded default model), "
                     f"tiny:<family> or a checkpoint folder (default: {','.join(DEFAULT_MODELS)})")
    cal.add_argument("--scenarios", action="append", default=[], metavar="ID",
                     help="only this scenario (repeatable; default: the whole tier)")
    cal.add_argument("--tier", default="default", choices=TIERS)
    cal.add_argument("--dtypes", default=",".join(ENGINE_DTYPES), metavar="DTYPES",
                     help="comma-separated engine dtypes, each scored against float32 and against itself "
                     f"(default: {','.join(ENGINE_DTYPES)})")
    cal.add_argument("--engines", default=",".join(ENGINES), metavar="ENGINES",
                     help=f"comma-separated engines of this project (default: {','.join(ENGINES)})")
    cal.add_argument("--out", default=None, metavar="FILE",
                     help="where the table goes (default: the packaged conformance/calibration.json)")
    cal.add_argument("--threads", type=int_at_least(1), default=1, help=THREADS_HELP)


def _triage_parser(sub) -> None:
    tr = sub.add_parser("triage", help="is a divergence a bug or numerics? run the engine and the "
                        "reference on prompts, rerun the controls, say which, and write a scenario file that "
                        "replays it")
    _common(tr)
    tr.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                    help="a text prompt (repeatable; needs a model with a tokenizer)")
    tr.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                    help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeatable)")
    tr.add_argument("--scenario-file", default=None, metavar="FILE",
                    help="the workload of this scenario file")
    tr.add_argument("--max-tokens", type=int_at_least(1), default=16, help="tokens per prompt (default 16)")
    tr.add_argument("-k", "--num-speculative-tokens", type=int_at_least(0), default=0, metavar="K",
                    help="speculative tokens per step for the prompts (default 0)")
    tr.add_argument("--spec-drafter", choices=DRAFTERS, default="mtp",
                    help="the drafter of the prompts' run with -k (default mtp)")
    tr.add_argument("--out", default="triage.json", metavar="FILE",
                    help="the scenario file that replays the divergence (default triage.json)")


def _selection(args) -> session.Selection:
    sel = session.Selection(
        engine=session.pick(args.engine, session.ENV_ENGINE, session.DEFAULT_ENGINE),
        model=session.pick(args.model, session.ENV_MODEL, None),
        tier=args.tier,
        device=session.pick(args.device, session.ENV_DEVICE, "cpu"),
        xfail_file=getattr(args, "xfail_file", None),
        dtype=session.pick(args.dtype, session.ENV_DTYPE, "float32"),
        enable_prefix_caching=args.enable_prefix_caching,
        mamba_cache_mode=args.mamba_cache_mode,
        step_timeout=args.step_timeout,
        allow_unexercised=getattr(args, "allow_unexercised", False),
        require_exercised=getattr(args, "require_exercised", False),
        drafter=getattr(args, "drafter", None),
        draft_model=getattr(args, "draft_model", None),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        verdict=getattr(args, "verdict", "exact"),
        reference_dtype=getattr(args, "reference_dtype", None),
        reference_device=getattr(args, "reference_device", None),
        tolerance=getattr(args, "tolerance", None),
    )
    if sel.device == "cpu":
        import torch

        torch.set_num_threads(args.threads)
    return sel


def cmd_list(args, out) -> int:
    shown = [d for d in scenario_defs() if args.tier is None or args.tier in d.tiers]
    width = max((len(d.id) for d in shown), default=0)
    for d in shown:
        tiers = "" if args.tier else f"  [{', '.join(d.tiers)}]"
        print(f"{d.id:<{width}} {d.description}{tiers}", file=out)
    return 0


RUN_REFUSALS = (UnknownEngine, UnknownScenario, ExpectationError, FileNotFoundError, ValueError, KeyError)


def cmd_run(args, out) -> int:
    """The shipped pytest suite, run in-process with this command's options (conformance.runner). A run
    that ends before its first scenario (an engine, checkpoint, device, scenario or expectations file
    that cannot be used, a required feature missing, Ctrl-C) still writes its --junit-xml and
    --report-json files, holding a ``gate`` (or ``interrupted``) error that names the reason."""
    from conformance.model import describe_model, run_dtype
    from conformance.runner import run_suite
    from refengine.config import check_device

    facts = None
    try:
        sel = _selection(args)
        adapter = session.resolve_engine(sel.engine)  # UnknownEngine: exit 2 before anything runs
        check_device("device", sel.device)
        resolve = getattr(adapter, "resolve_model", None)  # an outside engine's geometry of a tiny:* preset
        facts = describe_model(resolve(sel.model) if callable(resolve) else sel.model)  # weights: in the run
        check = getattr(adapter, "check_model", None)  # a checkpoint the engine cannot load: one line, exit 2
        if callable(check):
            check(facts.path, run_dtype(sel.dtype, facts))
        session.select_scenarios(sel.tier, args.scenario, args.scenario_file)
        sel.expectations()  # ExpectationError for an unreadable file
        for flag, path in (("--report-json", args.report_json), ("--junit-xml", args.junit_xml)):
            _report_folder(flag, path)
        lacking = missing_features(adapter, args.require_feature)
        if lacking:
            return _ended_before_the_run(args, facts, 1, f"the engine under test ({adapter.name}) does not "
                                         f"support required feature(s) {', '.join(lacking)} "
                                         "(--require-feature): the gate fails before any scenario runs")
        dtype = run_dtype(sel.dtype, facts)
        _check_verdict(sel, adapter, dtype, facts)  # VerdictError (no calibrated pair, ...): exit 2 up front
    except RUN_REFUSALS as e:
        return _ended_before_the_run(args, facts, 2, setting_message(e))
    except KeyboardInterrupt:
        return _ended_before_the_run(args, facts, 130, INTERRUPTED_BEFORE_THE_RUN, name="interrupted")
    try:
        return run_suite(sel, out=out, scenarios=args.scenario, scenario_files=args.scenario_file,
                         strict=args.strict_expectations, threads=args.threads, junit_xml=args.junit_xml,
                         report_json=args.report_json, exitfirst=args.exitfirst, verbose=args.verbose,
                         model_label=facts.label, dtype=dtype, fail_on_skip=args.fail_on_skip,
                         min_scenarios=args.min_scenarios, require_features=args.require_feature,
                         features=_features(adapter))
    except KeyboardInterrupt:  # before pytest's session started (it reports an interrupt of its own)
        return _ended_before_the_run(args, facts, 130, INTERRUPTED_BEFORE_THE_RUN, name="interrupted")


def _check_verdict(sel, adapter, dtype: str, facts) -> None:
    from conformance.model import run_dtype
    from conformance.verdict import choose

    ref = None if sel.reference_dtype is None else run_dtype(sel.reference_dtype, facts)
    choose(sel.verdict, bitwise=adapter.supports("bitwise"), dtype=dtype, reference_dtype=ref,
           device=sel.device, reference_device=sel.reference_device, tolerance=sel.tolerance)


INTERRUPTED_BEFORE_THE_RUN = ("interrupted (KeyboardInterrupt) before the first scenario; no scenario ran, "
                              "and no verdict covers any")


def _ended_before_the_run(args, facts, code: int, message: str, name: str = "gate") -> int:
    """Say why the run ended before its first scenario (one line on stderr, naming the reports written)
    and write the reports it asked for with a ``name`` error holding ``message``; returns ``code``."""
    from conformance.env import environment
    from conformance.report_files import gate_options, write_run_error_reports

    meta = {
        "engine": session.pick(args.engine, session.ENV_ENGINE, session.DEFAULT_ENGINE),
        "model": facts.label if facts else (session.pick(args.model, session.ENV_MODEL, None)
                                            or "embedded default model"),
        "family": facts.family if facts else "",
        "dtype": session.pick(args.dtype, session.ENV_DTYPE, "float32"),
        "tier": args.tier,
        "device": session.pick(args.device, session.ENV_DEVICE, "cpu"),
        "gate": gate_options(fail_on_skip=args.fail_on_skip, min_scenarios=args.min_scenarios,
                             require_features=args.require_feature, step_timeout=args.step_timeout,
                             require_exercised=getattr(args, "require_exercised", False)),
    }
    written = write_run_error_reports(args.junit_xml, args.report_json, name, message, meta,
                                      environment(probe_device=False))
    where = f" (reports written: {', '.join(written)})" if written else ""
    said = "interrupted before the first scenario" if name == "interrupted" else message
    print(f"conformance run: {said}{where}", file=sys.stderr)
    return code


def _features(adapter) -> dict[str, bool]:
    """The adapter's answers for every feature, for the run's header."""
    from conformance.api import FEATURES

    return {f: bool(adapter.supports(f)) for f in FEATURES}


def _report_folder(flag: str, path: str | None) -> None:
    """Create the folder of a report file before the run (a missing one is made, as for the JUnit file)
    and refuse a path that can never be written, instead of failing after the whole run."""
    from pathlib import Path

    if not path:
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a folder; name a file")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create its folder ({e.strerror or e})") from None


def _warn(result, out) -> None:
    """Warnings a check attached to an otherwise clean result (e.g. a trigger not exercised)."""
    for c in result.checks:
        if c.details.get("warning"):
            print(f"  warning: {c.details['warning']}", file=out, flush=True)


def cmd_replay(args, out) -> int:
    from conformance.harness import run_scenario
    from conformance.report_text import LEGEND, format_request_detail, format_result, format_step_table
    from conformance.workloads import get_def

    sel = _selection(args)
    if (args.scenario is None) == (args.scenario_file is None):
        raise ValueError("name a scenario id or a --scenario-file (exactly one)")
    if args.scenario is not None:
        session.select_scenarios(sel.tier, [args.scenario], [])  # UnknownScenario, naming the right tier
    else:
        session.select_scenarios(sel.tier, [], [args.scenario_file])  # the whole file, before any work
    case = sel.open_case()
    if args.scenario_file is not None:
        scenario = file_scenario(args.scenario_file, case.facts.vocab_size, sel.tier)
    else:
        scenario = get_def(args.scenario).materialize(sel.tier, case.facts.vocab_size)
    known = [r.request_id for r in scenario.requests]
    if args.request is not None and args.request not in known:  # said before the scenario runs
        print(f"conformance replay: no request {args.request!r} in {scenario.id} "
              f"(requests: {', '.join(known)})", file=sys.stderr)
        return 2
    result, traces = run_scenario(scenario, case, scenario_file=args.scenario_file)
    print(format_result(result, show_passing=True), file=out)
    _warn(result, out)
    if args.request is not None:
        print("\n" + format_request_detail(args.request, traces), file=out)
    elif traces:
        print("\n" + format_step_table(traces), file=out)
    if result.failures:  # the guide reads a failed check
        print("\n" + LEGEND, file=out)
    return 0 if result.ok else 1


def cmd_fuzz(args, out) -> int:
    try:
        from conformance.fuzz import fuzz
    except ModuleNotFoundError as e:
        if e.name != "hypothesis":
            raise
        print("conformance fuzz: needs hypothesis, a dependency of this package missing here (pip install "
              "hypothesis)", file=sys.stderr)
        return 2
    if args.draw_family:
        if args.model:
            print("conformance fuzz: --draw-family draws the model; drop --model", file=sys.stderr)
            return 2
        from conformance.tiny_models import draw_model

        args.model = draw_model(args.seed)
    sel = _selection(args)
    case = sel.open_case()
    budget = f"{args.examples} workloads" + (f" or {args.budget_seconds:g} s" if args.budget_seconds else "")
    print(
        f"conformance fuzz: engine under test {describe_engine(sel.engine)}, reference engine as oracle, "
        f"model {case.facts.label}, dtype {case.dtype} (both engines), seed {args.seed}, at most {budget}",
        file=out,
        flush=True,
    )
    shrinking, seen = [], [0]

    def progress(e):
        seen[0] = max(seen[0], e.index)
        if e.phase == "shrink" and not shrinking:
            shrinking.append(True)
            print(
                f"shrinking: '{e.failing[0] if e.failing else '?'}' failed; "
                "looking for a smaller workload on which it still fails",
                file=out,
                flush=True,
            )
        if args.quiet and not e.target_failed:
            return
        verdict = (
            ("SKIP " + e.skipped) if e.skipped else ("FAIL " + ", ".join(e.failing) if e.failing else "pass")
        )
        print(f"[{e.index:>4}] {e.phase:<8} {e.size}: {verdict} ({e.seconds:.1f} s)", file=out, flush=True)

    try:
        report = _fuzz(fuzz, args, case, progress)
    except KeyboardInterrupt:
        print(f"conformance fuzz: interrupted after {seen[0]} workload(s) of seed {args.seed}"
              f"{' (while shrinking a failure)' if shrinking else ''}; nothing was written", file=sys.stderr)
        return 130
    return _fuzz_verdict(args, report, out)


def _fuzz(fuzz, args, case, progress):
    from conformance.workloads.generate import Limits

    return fuzz(
        case,
        seed=args.seed,
        max_examples=args.examples,
        budget_seconds=args.budget_seconds,
        out_dir=args.out,
        limits=Limits(
            max_requests=args.max_requests, max_new_tokens=args.max_new_tokens, max_prompt=args.max_prompt
        ),
        shrink=not args.no_shrink,
        shrink_seconds=args.shrink_seconds,
        aborts=False if args.no_aborts else None,
        progress=progress,
    )


def _fuzz_verdict(args, report, out) -> int:
    from conformance.report_text import LEGEND, format_result

    s = report.search
    print(f"\n{s.examples} workloads in {s.seconds:.1f} s ({s.skipped} skipped); stopped by "
          f"{'a failure' if report.failed else s.stopped}", file=out)
    if not report.failed:
        print(f"no check failed (seed {args.seed})", file=out)
        return 0
    print(f"check '{s.check}' failed on a generated workload ({describe_first(s)}); shrunk over {s.shrinks} "
          f"smaller failing workloads to: {describe_last(s)}" if not args.no_shrink else
          f"check '{s.check}' failed on a generated workload ({describe_first(s)}); not shrunk", file=out)
    print(format_result(report.result), file=out)
    if not report.reproduced:
        print(f"warning: replaying the written file did not fail '{s.check}' again (the failure depends on "
              "something the file does not capture)", file=out)
    print(f"\nshrunk workload written to {report.file}\nreplay: {report.replay}\n\n{LEGEND}", file=out)
    return 1


def describe_first(search) -> str:
    from conformance.fuzz import describe_size

    return describe_size(search.first)


def describe_last(search) -> str:
    from conformance.fuzz import describe_size

    return describe_size(search.smallest)


def cmd_mutate(args, out) -> int:
    import torch

    from conformance.mutants import MUTANTS
    from conformance.mutants.run import format_score, run_mutants

    if args.list:
        for m in MUTANTS:
            print(f"{m.id:<28} {m.origin}; breaks {m.contract}\n{'':<28} {m.description}", file=out)
        return 0
    unknown = [m for m in args.mutant if m not in {m.id for m in MUTANTS}]
    if unknown:
        raise ValueError(f"unknown mutant {unknown[0]!r}; valid ids: {', '.join(m.id for m in MUTANTS)} "
                         "(`conformance mutate --list` says what each breaks)")
    torch.set_num_threads(args.threads)
    model = session.pick(args.model, session.ENV_MODEL, None)
    dtype = session.pick(args.dtype, session.ENV_DTYPE, "float32")
    print(
        f"conformance mutate: the async engine with one seed bug re-created at a time, against the reference "
        f"engine, model {model or 'embedded default model'} (a mutant of another family's mixer runs on "
        f"that family's tiny model, named on its line), tier {args.tier}, dtype {dtype} (both engines)",
        file=out,
        flush=True,
    )

    seen = []

    def progress(result, i, n):
        seen.append(result)
        verdict = (f"caught by {result.scenario}" if result.caught
                   else f"not tried: {result.untried}" if result.untried else "MISSED")
        print(f"[{i}/{n}] {result.mutant.id} on {result.model_name}: {verdict} in {result.seconds:.1f} s",
              file=out, flush=True)

    try:
        results = run_mutants(model, args.tier, args.mutant or None, progress=progress, dtype=dtype)
    except KeyboardInterrupt:
        done = len(seen)
        print(f"conformance mutate: interrupted after {done} mutant(s) "
              f"({sum(r.caught for r in seen)} caught); the score covers none of the rest", file=sys.stderr)
        return 130
    print("\n" + format_score(results), file=out)
    return 0 if all(r.caught or r.untried for r in results) else 1


def cmd_calibrate(args, out) -> int:
    from pathlib import Path

    import torch

    from conformance.calibrate import calibrate, format_table, write_table
    from conformance.verdict import CALIBRATION_FILE

    torch.set_num_threads(args.threads)
    models = [m for m in args.families.split(",") if m]
    dtypes = [d for d in args.dtypes.split(",") if d]
    engines = [e for e in args.engines.split(",") if e]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]
    if bad or not dtypes:
        raise ValueError(f"--dtypes: each must be float32, bfloat16 or float16, got {args.dtypes!r}")
    if not engines or any(e not in ("reference", "async") for e in engines):
        raise ValueError(f"--engines: each must be reference or async, got {args.engines!r}")
    if args.scenarios:
        session.select_scenarios(args.tier, args.scenarios, [])  # UnknownScenario before any work
    print(f"conformance calibrate: engines {', '.join(engines)} in {', '.join(dtypes)}, scored by the "
          f"reference in float32 and in each dtype, on {', '.join(models)}, tier {args.tier}"
          + (f", scenarios {', '.join(args.scenarios)}" if args.scenarios else ""), file=out, flush=True)
    partial = Path(args.out or CALIBRATION_FILE).with_suffix(".partial.json")  # what a long run measured
    table = calibrate(models, args.scenarios or None, dtypes, engines, args.tier,
                      log=lambda *a, **k: print(*a, file=out, **k),
                      progress=lambda t: write_table(t, partial))
    partial.unlink(missing_ok=True)
    print(format_table(table), file=out)
    print(f"calibration table written to {write_table(table, args.out)}", file=out)
    return 0


def cmd_triage(args, out) -> int:
    from conformance.triage import run_triage

    return run_triage(args, _selection(args), out)


def main(argv: list[str] | None = None, out=None) -> int:
    """The ``conformance`` command. Called without ``argv`` it is the process's entry point (the console
    script, ``python -m conformance``) and ends the process with the command's status (130 on Ctrl-C,
    once the reports are written) without finalizing the interpreter under engine threads that may be
    inside torch (refengine.tools.exits); with ``argv`` it returns the status, 130 included."""
    if argv is None:
        args = build_parser().parse_args(sys.argv[1:])  # --help and usage errors: before anything loads
        from refengine.tools.exits import process_main

        process_main(f"conformance {args.command}", lambda: _run(args, out))
    return _run(build_parser().parse_args(argv), out)


def _run(args, out=None) -> int:
    out = out or sys.stdout
    one_line_warnings(f"conformance {args.command}")
    try:
        commands = {
            "list": cmd_list,
            "run": cmd_run,
            "replay": cmd_replay,
            "fuzz": cmd_fuzz,
            "mutate": cmd_mutate,
            "calibrate": cmd_calibrate,
            "triage": cmd_triage,
        }
        return commands[args.command](args, out)
    except (UnknownEngine, UnknownScenario, ExpectationError, FileNotFoundError, ValueError, KeyError) as e:
        print(f"conformance {args.command}: {setting_message(e)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a command that stopped reading (| head)
        sys.stdout = None
        return 0
    except KeyboardInterrupt:  # `run` reports its own interruption (and its JUnit file says so)
        print(f"conformance {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
