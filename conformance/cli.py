"""``conformance``: run the conformance suite against an engine from the command line.

  conformance list [--tier T]                   scenario ids, one line each
  conformance run [--engine E] [--tier T] [--scenario ID ...] [--model PATH]
                  [--report-json F] [--junit-xml F] [--xfail-file F]
  conformance replay ID [--request R] [--engine E] [--model PATH]

Exit status: 0 when every check passed (or failed as listed in --xfail-file), 1 when a check
failed or a run broke, 2 for usage errors (unknown engine, scenario or model).
"""

from __future__ import annotations

import argparse
import sys
import time

from conformance import session
from conformance.engines import BUILTIN_ENGINES, UnknownEngine
from conformance.env import describe, environment
from conformance.expectations import ExpectationError, judge
from conformance.workloads import TIERS, UnknownScenario, scenario_defs, scenario_ids


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default=None, help=f"engine under test: {', '.join(BUILTIN_ENGINES)} or "
                   f"'package.module:factory' (default: ${session.ENV_ENGINE} or {session.DEFAULT_ENGINE})")
    p.add_argument("--model", default=None, help="checkpoint folder (default: $CONFORMANCE_MODEL or the "
                   "embedded default model)")
    p.add_argument("--tier", default="default", choices=TIERS, help="workload sizes (default: default)")
    p.add_argument("--device", default=None, help="device for both engines (default: $CONFORMANCE_DEVICE or cpu)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1: the "
                   "workloads are many small steps, where more threads only contend)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conformance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="list scenario ids with a one-line description")
    ls.add_argument("--tier", default=None, choices=TIERS, help="only this tier's scenarios (default: all)")
    run = sub.add_parser("run", help="run scenarios and check the engine under test")
    _common(run)
    run.add_argument("--scenario", action="append", default=[], metavar="ID", help="run only this scenario "
                     "(repeatable; default: the whole tier)")
    run.add_argument("--report-json", metavar="FILE", help="write every result as JSON")
    run.add_argument("--junit-xml", metavar="FILE", help="write a JUnit XML report")
    run.add_argument("--xfail-file", metavar="FILE", help="expected failures (TOML) that do not fail the run")
    run.add_argument("-v", "--verbose", action="store_true", help="print every check, passing ones included")
    rp = sub.add_parser("replay", help="rerun one scenario and print one request step by step")
    rp.add_argument("scenario", metavar="ID")
    rp.add_argument("--request", default=None, help="request id to print step by step")
    _common(rp)
    mu = sub.add_parser("mutate", help="run the suite against every mutant and print the mutation score")
    mu.add_argument("--mutant", action="append", default=[], metavar="ID", help="only this mutant (repeatable)")
    mu.add_argument("--model", default=None, help="checkpoint folder (default: the embedded default model)")
    mu.add_argument("--tier", default="default", choices=TIERS)
    mu.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    mu.add_argument("--list", action="store_true", help="list the mutants and what they break")
    return parser


def _selection(args) -> session.Selection:
    sel = session.Selection(
        engine=session.pick(args.engine, session.ENV_ENGINE, session.DEFAULT_ENGINE),
        model=session.pick(args.model, session.ENV_MODEL, None), tier=args.tier,
        device=session.pick(args.device, session.ENV_DEVICE, "cpu"), xfail_file=getattr(args, "xfail_file", None))
    if sel.device == "cpu":
        import torch

        torch.set_num_threads(args.threads)
    return sel


def cmd_list(args, out) -> int:
    for d in scenario_defs():
        if args.tier is None or args.tier in d.tiers:
            tiers = "" if args.tier else f"  [{', '.join(d.tiers)}]"
            print(f"{d.id:<26} {d.description}{tiers}", file=out)
    return 0


def cmd_run(args, out) -> int:
    from conformance.harness import run_scenario
    from conformance.report_files import build_json, build_junit, write_json, write_junit
    from conformance.report_text import LEGEND, format_result, format_summary, status_line

    sel = _selection(args)
    ids = args.scenario or scenario_ids(sel.tier)
    for sid in ids:
        if sid not in scenario_ids(sel.tier):
            raise UnknownScenario(f"scenario {sid!r} is not in tier {sel.tier!r}; `conformance list` shows the ids")
    case = sel.open_case()
    expectations = sel.expectations() if args.xfail_file else None
    env = environment()
    print(f"conformance: engine under test {sel.engine}, reference engine as oracle, model {case.facts.label}, "
          f"tier {sel.tier}, {len(ids)} scenarios; {describe(env)}", file=out, flush=True)
    start, results, bad = time.perf_counter(), [], 0
    for i, sid in enumerate(ids, 1):
        result, _ = run_scenario(sid, case)
        results.append(result)
        print(status_line(result, i, len(ids), time.perf_counter() - start), file=out, flush=True)
        verdict = judge(result, expectations) if expectations else None
        if verdict:
            result.expected = verdict.expected
        if verdict and verdict.stale:
            print(f"  warning: {verdict.stale_message(expectations.source)}", file=out)
        if verdict and verdict.outcome == "xfail":
            print(f"  expected failure(s): {verdict.expected}", file=out)
            continue
        if not result.ok or args.verbose:
            print(format_result(result, show_passing=args.verbose), file=out, flush=True)
        bad += not result.ok
    elapsed = time.perf_counter() - start
    if bad:
        print("\n" + LEGEND, file=out)
    print("\n" + format_summary(results, elapsed), file=out)
    meta = {"engine": sel.engine, "tier": sel.tier, "model": case.facts.label, "environment": env, "elapsed": elapsed}
    if args.report_json:
        write_json(args.report_json, build_json(results, **meta))
    if args.junit_xml:
        write_junit(args.junit_xml, build_junit(results, **meta))
    return 1 if bad else 0


def cmd_replay(args, out) -> int:
    from conformance.harness import run_scenario
    from conformance.report_text import LEGEND, format_request_detail, format_result

    sel = _selection(args)
    if args.scenario not in scenario_ids(sel.tier):
        raise UnknownScenario(f"scenario {args.scenario!r} is not in tier {sel.tier!r}")
    result, traces = run_scenario(args.scenario, sel.open_case())
    print(format_result(result, show_passing=True), file=out)
    if args.request is not None:
        if "reference" in traces and args.request not in traces["reference"].requests:
            known = ", ".join(sorted(traces["reference"].requests))
            print(f"conformance replay: no request {args.request!r} in {args.scenario} (requests: {known})",
                  file=sys.stderr)
            return 2
        print("\n" + format_request_detail(args.request, traces), file=out)
    if not result.ok:
        print("\n" + LEGEND, file=out)
    return 0 if result.ok else 1


def cmd_mutate(args, out) -> int:
    import torch

    from conformance.mutants import MUTANTS
    from conformance.mutants.run import format_score, run_mutants

    if args.list:
        for m in MUTANTS:
            print(f"{m.id:<28} {m.origin}; breaks {m.contract}\n{'':<28} {m.description}", file=out)
        return 0
    torch.set_num_threads(args.threads)
    model = session.pick(args.model, session.ENV_MODEL, None)

    def progress(result, i, n):
        verdict = f"caught by {result.scenario}" if result.caught else "MISSED"
        print(f"[{i}/{n}] {result.mutant.id}: {verdict} in {result.seconds:.1f} s", file=out, flush=True)

    results = run_mutants(model, args.tier, args.mutant or None, progress=progress)
    print("\n" + format_score(results), file=out)
    return 0 if all(r.caught for r in results) else 1


def main(argv: list[str] | None = None, out=None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    try:
        commands = {"list": cmd_list, "run": cmd_run, "replay": cmd_replay, "mutate": cmd_mutate}
        return commands[args.command](args, out)
    except (UnknownEngine, UnknownScenario, ExpectationError, FileNotFoundError, ValueError, KeyError) as e:
        print(f"conformance {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a command that stopped reading (| head)
        sys.stdout = None
        return 0


if __name__ == "__main__":
    sys.exit(main())
