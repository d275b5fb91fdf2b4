"""The nightly run: full conformance tier, slow and nightly tests, benchmarks, then a gate.

  python ci/nightly.py [--reports DIR] [--baseline ci/nightly-baseline.txt] [--engine async]
                      [--model CKPT] [--device cuda] [--tier nightly] [--no-strict] [--allow-skips]
                      [--step-timeout S] [--infra-reruns 1] [pytest args]

1. ``pytest -n auto`` over everything (``-m ""``: slow and nightly tests included) with the
   conformance suite at ``--conformance-tier nightly``, strict expectations and
   ``--conformance-fail-on-skip`` (a conformance scenario that skips fails: a gate that skipped what
   it exists for is not green; ``--allow-skips`` turns that off) -> tests.xml, tests.log. A scenario whose
   reference run misses a workload trigger fails too: ``--allow-unexercised`` is refused here. On the
   models the corpus is tuned to (the embedded default model, a ``tiny:`` preset) the run also passes
   ``--conformance-require-exercised``: a trigger or parameter the checkpoint decides must be exercised
   too; on a checkpoint of the user's (``--model``, ``$CONFORMANCE_MODEL``) such a miss stays a warning
   and a named gap of the summary.
2. Reruns happen inside that same pytest run, with the pytest-rerunfailures plugin: a test that
   fails or errors with an *infrastructure* exception (InfrastructureError, out of memory, timeout,
   lost connection: the types in summarize_junit.INFRA_TYPES) is run again, at most
   ``--infra-reruns`` times (0: never). So is a test whose xdist worker crashed. Being the same run,
   a rerun has exactly its options (marker selection, tier, engine, strict flag, model, device).
   A conformance mismatch or a failed assertion is never rerun, even when raised while handling an
   infrastructure error: a mismatch that passes on a second try is itself a nondeterminism bug.
   tests.xml has one testcase per attempt; the summary counts each test's final attempt only and
   says how many reruns there were (read from pytest's last line in tests.log).
3. Benchmarks (kernel benches with pytest-benchmark, ``refengine bench``) -> bench.xml, bench.json.
4. ``NIGHTLY_EXTRA_COMMANDS``, each writing its own JUnit file into the reports folder.
5. A markdown summary (also appended to $GITHUB_STEP_SUMMARY) and the gate: exit 1 only when a
   failure is not in the committed baseline (ci/nightly-baseline.txt).

Suite and rerun options go through this script's flags, never free pytest arguments: a free one
would silently override the flag (the last one wins) or widen the reruns to real failures.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from summarize_junit import INFRA_TYPES, MISMATCH_LINE, Case, compare, load_baseline, markdown, read_junit

REPO = Path(__file__).resolve().parents[1]

# Hook point: further nightly jobs. Each entry is a command (a list of arguments; "{reports}" is
# replaced by the reports folder) that writes a JUnit XML file into that folder; its testcases join
# the summary and the gate.
NIGHTLY_EXTRA_COMMANDS: tuple[tuple[str, ...], ...] = (
    # Every mutant caught over the whole tier, twice (determinism), with its time to catch.
    (sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "junit_family=xunit1", "-m",
     "slow or not slow", "tests/conformance/test_mutants.py", "--junitxml={reports}/mutants.xml"),
)
# pytest's last line: "==== 1 failed, 9 passed, 2 rerun in 12.34s ====".
SUMMARY_LINE = re.compile(r"\bin \d+(?:\.\d+)?s\b")
# Free pytest arguments that would override this script's suite options or widen its reruns.
RESERVED_ARGS = ("--conformance-", "-m", "--reruns", "--rerun-", "--only-rerun", "--force-reruns")


def run(cmd: list[str], log: Path | None = None) -> int:
    print("+", " ".join(cmd), flush=True)
    if log is None:
        return subprocess.call(cmd, cwd=REPO)
    with log.open("w") as f:
        return subprocess.call(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)


def pytest_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-rxXfER", "-o", "junit_family=xunit1", *args]


def suite_options(args: argparse.Namespace) -> list[str]:
    """The options that define the nightly run (its reruns, in the same pytest run, share them)."""
    opts = ["-m", "", "--conformance-tier", args.tier]
    if args.strict:
        opts.append("--conformance-strict-expectations")
    if not args.allow_skips:
        opts.append("--conformance-fail-on-skip")
    if on_a_preset(args.model):  # the corpus is tuned to it: every trigger and bound is reached there
        opts.append("--conformance-require-exercised")
    if args.step_timeout is not None:
        opts += ["--conformance-step-timeout", str(args.step_timeout)]
    for flag, value in (("--conformance-engine", args.engine), ("--conformance-model", args.model),
                        ("--conformance-device", args.device)):
        if value:
            opts += [flag, value]
    return opts


def on_a_preset(model: str | None) -> bool:
    """Whether the suite runs on a model the corpus is tuned to: the embedded default model (no --model and
    no $CONFORMANCE_MODEL) or a ``tiny:`` preset."""
    model = model or os.environ.get("CONFORMANCE_MODEL")
    return not model or model.startswith("tiny:")


def rerun_options(reruns: int) -> list[str]:
    """pytest-rerunfailures options: up to ``reruns`` reruns of a test whose exception chain holds an
    infrastructure error (``Type: message`` starts with a type of INFRA_TYPES) and no mismatch or
    failed assertion (what summarize_junit classifies as a mismatch); none when ``reruns`` is 0."""
    if reruns <= 0:
        return []
    only = [opt for name in sorted(INFRA_TYPES) for opt in ("--only-rerun", f"^{re.escape(name)}:")]
    return ["--reruns", str(reruns), *only, "--rerun-except", MISMATCH_LINE.pattern]


def reruns_in_log(log: Path) -> int | None:
    """How many reruns pytest made: the "N rerun" of its summary line ("... in 12.3s"), the last such
    line in ``log``; 0 when that line names none, None when there is none."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    summary = next((line for line in reversed(text.splitlines()) if SUMMARY_LINE.search(line)), None)
    if summary is None:
        return None
    m = re.search(r"\b(\d+) rerun\b", summary)
    return int(m.group(1)) if m else 0


def rerun_note(reruns: int, log: Path) -> str:
    """The summary's line about infrastructure reruns."""
    if reruns <= 0:
        return "infrastructure reruns: off (--infra-reruns 0)"
    count = reruns_in_log(log)
    found = "unknown (no pytest summary line in tests.log)" if count is None else f"{count} rerun"
    return f"infrastructure reruns (at most {reruns} per test): {found}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reports", default=str(REPO / "reports" / "nightly"))
    p.add_argument("--baseline", default=str(REPO / "ci" / "nightly-baseline.txt"))
    p.add_argument("--engine", default=os.environ.get("CONFORMANCE_ENGINE"), help="engine under test")
    p.add_argument(
        "--model", default=None, help="checkpoint folder (default: $CONFORMANCE_MODEL or the embedded one)"
    )
    p.add_argument(
        "--device", default=None, help="device for both engines (default: $CONFORMANCE_DEVICE or cpu)"
    )
    p.add_argument(
        "--tier", default="nightly", choices=("default", "nightly"), help="conformance workload tier"
    )
    p.add_argument("--no-strict", dest="strict", action="store_false",
                   help="stale expected-failure entries warn instead of failing")
    p.add_argument("--allow-skips", action="store_true",
                   help="a skipped conformance scenario does not fail the run (default: it fails)")
    p.add_argument("--step-timeout", type=float, default=None,
                   help="seconds an engine call may take before its scenario fails (default: the suite's)")
    p.add_argument("--infra-reruns", type=int, default=1,
                   help="reruns of a test after an infrastructure failure (0: none)")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("pytest_args", nargs="*", help="passed on to the main pytest run (e.g. test paths)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    unexercised = [a for a in argv or sys.argv[1:] if a.lstrip("-").endswith("allow-unexercised")]
    if unexercised:  # a scenario that did not test what it exists for is a failure of the nightly, always
        p.error(f"{unexercised[0]}: the nightly gate never allows a missed workload trigger (a scenario that "
                "did not test what it exists for fails it)")
    args = p.parse_args(argv)
    reserved = [a for a in args.pytest_args if a.startswith(RESERVED_ARGS)]
    if reserved:
        p.error(f"pass {reserved[0]} through this script's flags (--engine, --model, --device, --tier, "
                "--no-strict, --allow-skips, --step-timeout, --infra-reruns): as a free pytest argument it "
                "would override them")
    reports = Path(args.reports)
    reports.mkdir(parents=True, exist_ok=True)

    log = reports / "tests.log"
    run(pytest_cmd("-n", "auto", *suite_options(args), *rerun_options(args.infra_reruns),
                   "--conformance-report-json", str(reports / "conformance.json"),
                   "--junitxml", str(reports / "tests.xml"), *args.pytest_args), log)
    cases = read_junit([reports / "tests.xml"]) if (reports / "tests.xml").is_file() else []
    if not cases:
        cases = [Case("nightly::pytest", "error", "the test run wrote no JUnit report (see tests.log)")]
    notes = [rerun_note(args.infra_reruns, log)]

    if not args.skip_bench:
        run(
            pytest_cmd(
                "tests/kernels/bench",
                "-p",
                "no:xdist",
                "-m",
                "",
                "--benchmark-only",
                "--benchmark-json",
                str(reports / "bench.json"),
                "--junitxml",
                str(reports / "bench.xml"),
            ),
            reports / "bench.log",
        )
        code = run([sys.executable, "-m", "refengine.tools.cli", "bench"], reports / "engine-bench.txt")
        notes.append(f"engine benchmark: exit {code}, output in engine-bench.txt")
        if (reports / "bench.xml").is_file():
            cases += read_junit([reports / "bench.xml"])
    for cmd in NIGHTLY_EXTRA_COMMANDS:
        run([part.replace("{reports}", str(reports)) for part in cmd])
    for extra in sorted(reports.glob("*.xml")):
        if extra.name not in ("tests.xml", "bench.xml"):
            cases += read_junit([extra])

    comparison = compare(cases, load_baseline(args.baseline))
    summary = markdown(cases, comparison, "Nightly", notes)
    (reports / "summary.md").write_text(summary)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as f:
            f.write(summary)
    print(summary)
    return 1 if comparison.new else 0


if __name__ == "__main__":
    sys.exit(main())
