"""The nightly run: full conformance tier, slow and nightly tests, benchmarks, then a gate.

  python ci/nightly.py [--reports DIR] [--baseline ci/nightly-baseline.txt] [--engine async]
                      [--model CKPT] [--device cuda] [--tier nightly] [--no-strict] [pytest args]

1. ``pytest -n auto`` over everything (``-m ""``: slow and nightly tests included) with the
   conformance suite at ``--conformance-tier nightly`` and strict expectations -> tests.xml.
2. Reruns: only failures classified as *infrastructure* (crashed worker, out of memory, timeout)
   are rerun, at most ``--infra-reruns`` times, with exactly the suite options of the first run
   (marker selection, tier, engine, strict flag, model, device): a scenario that exists only in the
   nightly tier is found again. A token mismatch or any failed check is never rerun: a mismatch
   that passes on a second try is itself a nondeterminism bug. The suite options are this script's
   flags, never free pytest arguments, so the rerun cannot lose one.
3. Benchmarks (kernel benches with pytest-benchmark, ``refengine bench``) -> bench.xml, bench.json.
4. ``NIGHTLY_EXTRA_COMMANDS``, each writing its own JUnit file into the reports folder.
5. A markdown summary (also appended to $GITHUB_STEP_SUMMARY) and the gate: exit 1 only when a
   failure is not in the committed baseline (ci/nightly-baseline.txt).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from summarize_junit import FAILING, INFRASTRUCTURE, Case, compare, load_baseline, markdown, read_junit

REPO = Path(__file__).resolve().parents[1]

# Hook point: further nightly jobs. Each entry is a command (a list of arguments; "{reports}" is
# replaced by the reports folder) that writes a JUnit XML file into that folder; its testcases join
# the summary and the gate.
NIGHTLY_EXTRA_COMMANDS: tuple[tuple[str, ...], ...] = (
    # Every mutant caught over the whole tier, twice (determinism), with its time to catch.
    (sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "slow or not slow",
     "tests/conformance/test_mutants.py", "--junitxml={reports}/mutants.xml"),
)


def run(cmd: list[str], log: Path | None = None) -> int:
    print("+", " ".join(cmd), flush=True)
    if log is None:
        return subprocess.call(cmd, cwd=REPO)
    with log.open("w") as f:
        return subprocess.call(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)


def pytest_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-rxXfE", "-o", "junit_family=xunit1", *args]


def node_id(case: Case) -> str | None:
    """JUnit classname::name back to a pytest node id (module path + classes), if the file exists."""
    classname, _, name = case.id.partition("::")
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = Path(*parts[:i]).with_suffix(".py")
        if (REPO / path).is_file():
            return "::".join([path.as_posix(), *parts[i:], name])
    return None


def suite_options(args: argparse.Namespace) -> list[str]:
    """The options that define the nightly run; the first run and every rerun pass exactly these."""
    opts = ["-m", "", "--conformance-tier", args.tier]
    if args.strict:
        opts.append("--conformance-strict-expectations")
    for flag, value in (("--conformance-engine", args.engine), ("--conformance-model", args.model),
                        ("--conformance-device", args.device)):
        if value:
            opts += [flag, value]
    return opts


def rerun_infrastructure(cases: list[Case], reports: Path, attempts: int,
                         options: list[str]) -> tuple[list[Case], list[str]]:
    """Rerun infrastructure failures only, with the first run's ``options``; returns the merged
    cases and notes for the summary."""
    notes = []
    for attempt in range(1, attempts + 1):
        infra = [c for c in cases if c.outcome in FAILING and c.kind == INFRASTRUCTURE]
        never = [c.id for c in cases if c.outcome in FAILING and c.kind != INFRASTRUCTURE]
        if never:
            notes.append(f"not rerun (real failures): {len(never)}")
        ids = [i for i in map(node_id, infra) if i]
        if not ids:
            break
        xml = reports / f"tests-rerun{attempt}.xml"
        run(pytest_cmd(*options, "-p", "no:randomly", "--junitxml", str(xml), *ids))
        again = {c.id: c for c in read_junit([xml])} if xml.is_file() else {}
        recovered = [c.id for c in infra if c.id in again and again[c.id].outcome not in FAILING]
        notes.append(f"infrastructure rerun {attempt}: {len(ids)} rerun, {len(recovered)} passed: "
                     + ", ".join(f"`{r}`" for r in recovered))
        cases = [again.get(c.id, c) if c in infra else c for c in cases]
    return cases, notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reports", default=str(REPO / "reports" / "nightly"))
    p.add_argument("--baseline", default=str(REPO / "ci" / "nightly-baseline.txt"))
    p.add_argument("--engine", default=os.environ.get("CONFORMANCE_ENGINE"), help="engine under test")
    p.add_argument("--model", default=None, help="checkpoint folder (default: $CONFORMANCE_MODEL or the embedded one)")
    p.add_argument("--device", default=None, help="device for both engines (default: $CONFORMANCE_DEVICE or cpu)")
    p.add_argument("--tier", default="nightly", choices=("default", "nightly"), help="conformance workload tier")
    p.add_argument("--no-strict", dest="strict", action="store_false",
                   help="stale expected-failure entries warn instead of failing")
    p.add_argument("--infra-reruns", type=int, default=1)
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("pytest_args", nargs="*", help="passed on to the main pytest run (e.g. test paths)")
    args = p.parse_args(argv)
    suite_args = [a for a in args.pytest_args if a.startswith(("--conformance-", "-m"))]
    if suite_args:
        p.error(f"pass {suite_args[0]} through this script's flags (--engine, --model, --device, --tier, "
                "--no-strict) so the infrastructure reruns repeat it")
    reports = Path(args.reports)
    reports.mkdir(parents=True, exist_ok=True)

    options = suite_options(args)
    run(pytest_cmd("-n", "auto", *options, "--conformance-report-json", str(reports / "conformance.json"),
                   "--junitxml", str(reports / "tests.xml"), *args.pytest_args), reports / "tests.log")
    cases = read_junit([reports / "tests.xml"]) if (reports / "tests.xml").is_file() else []
    if not cases:
        cases = [Case("nightly::pytest", "error", "the test run wrote no JUnit report (see tests.log)")]
    cases, notes = rerun_infrastructure(cases, reports, args.infra_reruns, options)

    if not args.skip_bench:
        run(pytest_cmd("tests/kernels/bench", "-p", "no:xdist", "-m", "", "--benchmark-only",
                       "--benchmark-json", str(reports / "bench.json"), "--junitxml", str(reports / "bench.xml")),
            reports / "bench.log")
        code = run([sys.executable, "-m", "refengine.tools.cli", "bench"], reports / "engine-bench.txt")
        notes.append(f"engine benchmark: exit {code}, output in engine-bench.txt")
        if (reports / "bench.xml").is_file():
            cases += read_junit([reports / "bench.xml"])
    for cmd in NIGHTLY_EXTRA_COMMANDS:
        run([part.replace("{reports}", str(reports)) for part in cmd])
    for extra in sorted(reports.glob("*.xml")):
        if extra.name not in ("tests.xml", "bench.xml") and not extra.name.startswith("tests-rerun"):
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
